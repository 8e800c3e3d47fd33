"""Teacher forcing through SGLang's custom logit processor (SGLang 0.5.23): score a given
continuation token by token through a server's real decode path, sparse caches and evictions
included.

Why a logit processor: SGLang computes the logprobs it returns *after* custom processors ran, so a
processor that forces the next token would report log 1 = 0 for it. `ForcedContinuation` therefore
reads the model's own logits first and records, for every step, the log-probability of the forced
token and the model's own top token; then it masks every other token, so the forced one is the
sampled one and the next step is conditioned on the given text, not on the model's choice.

The records go into the request's `customized_info[KEY]`, one per output token, which SGLang
returns to the client in `meta_info[KEY]`. The server needs `--enable-custom-logit-processor`; a
request sends `custom_logit_processor=ForcedContinuation.to_str()` and
`sampling_params.custom_params={"forced_ids": [...]}` (bench/fidelity.py does).

The step is counted from the request's own records, not from `len(req.output_ids)`: under the
overlap scheduler the next step is sampled before the previous token is appended. Steps past the
forced ids (an overlap scheduler's discarded extra step) are left to the model and not recorded.
Neither is a prompt's middle chunk: with chunked prefill SGLang samples a token for every row of
the batch, the chunked request's too, and discards it; recording it would shift every later step.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

#: The `meta_info` key of the records: a list of [logprob of the forced token, model's top id].
KEY = "kvsparse_teacher_forcing"


class ForcedContinuation(CustomLogitProcessor):
    """Force `custom_params["forced_ids"]`, recording what the model itself predicted."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            forced = params["forced_ids"]
            req = params["__req__"]
            if self.is_middle_chunk(req):
                continue
            if req.customized_info is None:
                req.customized_info = {}
            records = req.customized_info.setdefault(KEY, [])
            step = len(records)
            if step >= len(forced):
                continue
            token = int(forced[step])
            logprobs = torch.log_softmax(logits[row].float(), dim=-1)
            records.append([float(logprobs[token]), int(torch.argmax(logprobs))])
            logits[row] = float("-inf")
            logits[row, token] = 0.0
        return logits

    @staticmethod
    def is_middle_chunk(req: Any) -> bool:
        """Whether this forward prefills a chunk of `req`'s prompt that is not its last.

        In SGLang 0.5.23 a round extends the request's tokens up to `req.extend_end`, and
        `full_untruncated_fill_ids` holds its whole input (prompt and outputs so far) from the round's
        start; the two are equal on a prompt's last chunk, and a decode round never moves
        `extend_end` below the end. Both are set while scheduling, before the forward samples.
        """
        return req.extend_end is not None and req.extend_end < len(req.full_untruncated_fill_ids)
