"""Profiles of the serving benchmark (``bench/serving.py --profile NAME``).

A profile fixes everything both systems share (model, KV pool, workload, concurrency sweep) and,
per project variant, only the ``--kvsparse-*`` flags. So a comparison never differs in anything
but sparsity, and turning sparsity on later is a one-line change of a variant's flags here (or
``--project-flags`` on the command line, without editing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.client import SharedPrefix
from common.systems import ServerSettings

#: The project's side with sparsity off: the same code path as stock SGLang plus the plugin; a
#: project-off vs stock run should give ratios near 1, which is how the harness itself is checked.
PROJECT_OFF = ("--kvsparse-preset", "off")
#: The launcher's default preset for the embedded model (layer 0 full, 1,024 elsewhere).
PROJECT_DEFAULT = ("--kvsparse-preset", "default")
#: The default guided at every budget (`guide_below` null): what a prefill costs without the switch.
PROJECT_GUIDED = ("--kvsparse-preset", "default", "--kvsparse-config", '{"guide_below": null}')
#: A tight budget: the default with 256 entries in each sparse layer.
PROJECT_BUDGET_256 = ("--kvsparse-preset", "default", "--kvsparse-budget", "256")
#: The published setting: layers 0-2 full.
NOVITA_SPARSITY = ("--kvsparse-full-layers", "0,1,2")
#: SGLang's own switch, for a variant that shows what prefix reuse is worth.
NO_PREFIX_REUSE = ("--disable-radix-cache",)


@dataclass(frozen=True)
class Variant:
    """One system to compare with stock SGLang in the model's dtype: the project's launcher with
    ``flags``, or (``stock``) stock SGLang, either with its KV cache in ``kv_dtype`` (a
    ``--kv-cache-dtype`` value; None: the model's dtype). An FP8 cache gets the profile's KV
    bytes, so as many more tokens as its values are smaller."""

    name: str
    flags: tuple[str, ...] = ()
    kv_dtype: str | None = None
    stock: bool = False


@dataclass(frozen=True)
class Profile:
    """Everything one serving benchmark run needs.

    ``model`` is ``"default"`` (the embedded SmolLM2-135M) or the name of a folder under
    ``bench/models`` served with dummy weights. ``num_prompts`` at a concurrency C is
    ``max(min_prompts, prompts_per_slot × C)``: enough requests that every slot is used; with
    ``shared_prefix`` it is the dataset's groups × prompts per group at every level, and
    ``input_len`` is the shared system prompt's length.
    """

    name: str
    description: str
    model: str
    device: str  # "cpu", "gpu", or "auto" (whichever this machine has): chooses the CPU flags
    dtype: str
    input_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    variants: tuple[Variant, ...]
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    prompts_per_slot: int = 1
    min_prompts: int = 2
    seed: int = 1
    #: Decode steps between scheduler log lines; 1 lets the peak of running requests be read
    #: exactly from the log. Costs a log line per step, which is nothing next to a CPU step.
    decode_log_interval: int = 1
    startup_timeout_s: float = 900.0
    client_timeout_s: float = 3600.0
    shape: str = "full"  # a dummy model's shape: common.models.SHAPES
    shared_prefix: SharedPrefix | None = None
    tp_size: int = 1  # both systems' --tp-size

    @property
    def prompt_len(self) -> int:
        """Tokens of one prompt (system prompt and question with a shared prefix)."""
        return self.input_len + (self.shared_prefix.question_len if self.shared_prefix else 0)

    def server_settings(self) -> ServerSettings:
        return ServerSettings(
            self.model,
            self.device,
            self.dtype,
            self.max_total_tokens,
            self.mem_fraction_static,
            self.decode_log_interval,
            self.startup_timeout_s,
            self.shape,
            self.tp_size,
        )

    def num_prompts(self, concurrency: int) -> int:
        if self.shared_prefix is not None:
            return self.shared_prefix.num_prompts
        return max(self.min_prompts, self.prompts_per_slot * concurrency)

    def dry_run(self) -> Profile:
        """The same profile at tiny sizes on this CPU: checks the script end to end in minutes.

        A dummy-weights model keeps its architecture and vocabulary but gets the small shape of
        ``common.models.SHAPES["dry-run"]`` (4 layers, so gpu-novita's full layers 0-2 still fit).
        Only the first variant of each kind (stock or project, KV dtype) runs: the others take the
        same path with other flags.
        """
        kinds: dict[tuple[bool, str | None], Variant] = {}
        for variant in self.variants:
            kinds.setdefault((variant.stock, variant.kv_dtype), variant)
        return dataclasses.replace(
            self,
            variants=tuple(kinds.values()),
            name=f"{self.name}-dry-run",
            description=f"CPU dry run of `{self.name}` at tiny sizes (timings mean nothing). " + self.description,
            device="cpu",
            dtype="float32",
            input_len=200,
            output_len=8,
            concurrencies=(1, 2),
            # Enough KV bytes that the sparse pools, split for the profile's request length,
            # still hold one request at its budget.
            max_total_tokens=16384,
            mem_fraction_static=None,
            prompts_per_slot=1,
            min_prompts=2,
            startup_timeout_s=600.0,
            client_timeout_s=600.0,
            shape="dry-run",
        )


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile(
            name="smoke",
            description="Tiny end-to-end check of the harness (used by the test suite).",
            model="default",
            device="auto",
            dtype="float32",
            input_len=200,
            output_len=8,
            concurrencies=(1, 2),
            variants=(Variant("project", PROJECT_OFF),),
            max_total_tokens=4096,
            startup_timeout_s=600.0,
            client_timeout_s=600.0,
        ),
        Profile(
            name="cpu-quick",
            description="Default model on the CPU, 2,000 in / 128 out, concurrency 1, 4, 8. "
            "One request per slot (each concurrency level is one full batch), to finish in "
            "under 15 minutes on 2 cores.",
            model="default",
            device="cpu",
            dtype="float32",
            input_len=2000,
            output_len=128,
            concurrencies=(1, 4, 8),
            variants=(Variant("project", PROJECT_DEFAULT),),
            max_total_tokens=24576,
        ),
        Profile(
            name="cpu-long",
            description="Default model on the CPU, 4,000 in / 256 out, concurrency 1 to 16, with "
            "a KV pool (--max-total-tokens 12288) that holds only two dense requests: the "
            "memory-bound regime where keeping fewer tokens should admit more requests.",
            model="default",
            device="cpu",
            dtype="float32",
            input_len=4000,
            output_len=256,
            concurrencies=(1, 4, 8, 16),
            variants=(Variant("default", PROJECT_DEFAULT), Variant("budget-256", PROJECT_BUDGET_256)),
            max_total_tokens=12288,
            client_timeout_s=7200.0,
        ),
        Profile(
            name="cpu-shared-prefix",
            description="Default model on the CPU: 4 groups of 4 prompts, each a shared "
            "3,000-token system prompt and its own 100-token question, 64 out, concurrency 4 and "
            "8, with the radix cache on for both systems (a group's later requests can hit its "
            "first). The project's default preset reuses prefixes through its prefix store; the "
            "no-prefix-reuse variant is the same with SGLang's radix cache disabled.",
            model="default",
            device="cpu",
            dtype="float32",
            input_len=3000,
            output_len=64,
            concurrencies=(4, 8),
            variants=(
                Variant("default", PROJECT_DEFAULT),
                Variant("default-no-prefix-reuse", (*PROJECT_DEFAULT, *NO_PREFIX_REUSE)),
            ),
            max_total_tokens=24576,
            shared_prefix=SharedPrefix(groups=4, prompts_per_group=4, question_len=100),
        ),
        Profile(
            name="gpu-novita",
            description="Llama-3.1-8B shape with dummy weights on one GPU, 5,000 in / 500 out, "
            "concurrency 1 to 32; sparsity with layers 0-2 full and a budget of 1,536, then "
            "1,024, in the other layers. KV pool capped at 65,536 tokens so that dense requests "
            "(5,500 tokens each) fit 11 at a time: the regime where sparsity adds capacity.",
            model="llama-3.1-8b",
            device="gpu",
            dtype="bfloat16",
            input_len=5000,
            output_len=500,
            concurrencies=(1, 4, 8, 16, 32),
            variants=(
                Variant("project-b1536", (*NOVITA_SPARSITY, "--kvsparse-budget", "1536")),
                Variant("project-b1024", (*NOVITA_SPARSITY, "--kvsparse-budget", "1024")),
            ),
            max_total_tokens=65536,
            mem_fraction_static=0.85,
            startup_timeout_s=300.0,
            client_timeout_s=300.0,
        ),
    )
}


def _gpu_long_out(output_len: int) -> Profile:
    """Long outputs on a GPU with SGLang (the CPU's context and speed cannot serve them): 1,000 in /
    `output_len` out at concurrency 8-64, the default preset against stock, the pool of gpu-novita."""
    name = f"gpu-long-out-{output_len // 1000}k"
    return dataclasses.replace(
        PROFILES["gpu-novita"],
        name=name,
        description=f"Llama-3.1-8B shape with dummy weights on one GPU, 1,000 in / {output_len:,} out, "
        "concurrency 8 to 64; the default preset (layer 0 full, 1,024 entries in the others) against stock. "
        f"KV pool capped at 65,536 tokens: {65536 // (1000 + output_len)} dense requests at their final length.",
        input_len=1000,
        output_len=output_len,
        concurrencies=(8, 16, 32, 64),
        variants=(Variant("default", PROJECT_DEFAULT),),
        client_timeout_s=3600.0,
    )


PROFILES.update({profile.name: profile for profile in (_gpu_long_out(4000), _gpu_long_out(8000))})

#: cpu-long with FP8 KV caches beside: stock's (through the CPU's FP8 reference) and the default's.
PROFILES["cpu-long-fp8"] = dataclasses.replace(
    PROFILES["cpu-long"],
    name="cpu-long-fp8",
    description="cpu-long with FP8 KV caches (e4m3) at the same KV bytes (the float32 pool's 12,288 "
    "tokens, so 49,152 FP8 tokens): stock in float32 and in FP8 (on this CPU through the FP8 reference, "
    "`patches/cpu_fp8.py`), the default preset in float32 and in FP8. On a GPU the model's dtype is "
    "bfloat16, so FP8 halves a value there where here it quarters one.",
    variants=(
        Variant("stock-fp8", kv_dtype="fp8_e4m3", stock=True),
        Variant("default", PROJECT_DEFAULT),
        Variant("default-fp8", PROJECT_DEFAULT, kv_dtype="fp8_e4m3"),
    ),
)

#: The serving step of `bench/gpu_check.py`: gpu-novita cut to fit one lent-GPU run.
PROFILES["gpu-check-serving"] = dataclasses.replace(
    PROFILES["gpu-novita"],
    name="gpu-check-serving",
    description="The serving step of bench/gpu_check.py: gpu-novita at concurrency 8 and 32 with one "
    "sparse variant (layers 0-2 full, budget 1,024), to fit one lent-GPU run.",
    concurrencies=(8, 32),
    variants=(Variant("project-b1024", (*NOVITA_SPARSITY, "--kvsparse-budget", "1024")),),
)

#: The same at `--tp-size 2` (two GPUs): stock and project each on two ranks.
PROFILES["gpu-check-serving-tp2"] = dataclasses.replace(
    PROFILES["gpu-check-serving"],
    name="gpu-check-serving-tp2",
    description="The tensor-parallel serving step of bench/gpu_check.py: gpu-check-serving with "
    "--tp-size 2 for stock and project alike (each rank holds half the KV heads).",
    tp_size=2,
)
