"""Requests' own sparsity settings, checked in SGLang's HTTP process (SGLang 0.5.23 internals).

AFTER `TokenizerManager._create_tokenized_object`: the tokenized request carries its prompt's
token ids and its sampling parameters, `custom_params` included (from `/generate`'s
`sampling_params` or the OpenAI endpoints' `custom_params`). A bad `custom_params.kvsparse`
raises ValueError with a message naming the field, which SGLang's HTTP server answers with a 400
before the request reaches a scheduler (`request_sparsity.check_request`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sglang_kvsparse.config import ResolvedSparsity, SparsityConfig
from sglang_kvsparse.config.request_sparsity import check_request


def make_check_setting(config: SparsityConfig):
    """The AFTER hook for `hooks.CREATE_REQUEST`, bound to the configuration."""

    @cache
    def resolved(num_layers: int, context_len: int) -> ResolvedSparsity:
        return config.resolve(num_layers, context_len)

    def check_setting(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
        params = getattr(result, "sampling_params", None)
        if params is None:  # an embedding request: nothing to check
            return
        model = manager.model_config
        server = resolved(model.num_hidden_layers, model.context_len)
        check_request(params.custom_params, len(result.input_ids or ()), params.max_new_tokens, server)

    return check_setting
