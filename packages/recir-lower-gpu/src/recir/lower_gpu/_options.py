"""GPUOptions: what a user tunes when lowering a StepGraph with Inductor, with safe defaults.

Each option maps to an Inductor config patch or to a behaviour of the compiled step; nothing here
reads global configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from recir.transforms import ConfigError

from ._cpp_codegen import CPU_BF16_MODES, CPU_SIGMOID_MODES, codegen_patches

InductorMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
INDUCTOR_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class GPUOptions:
    """Options of :func:`recir.lower_gpu.compile`.

    - ``mode``: Inductor mode. ``reduce-overhead`` is ``default`` plus CUDA graphs on CUDA;
      ``max-autotune-no-cudagraphs`` autotunes matmul/conv templates (slow compile, faster GEMMs).
    - ``cuda_graphs``: replay the whole step as one CUDA graph on CUDA (batches are copied into
      static buffers). ``None`` means "on with mode reduce-overhead, else off". Ignored on CPU.
    - ``in_place``: update state through the signature's state-in/state-out pairing (a ``copy_``
      epilogue Inductor fuses into the kernels that compute the new state), so a step allocates no
      second persistent copy of parameters or optimizer state. ``False`` returns fresh state tensors.
    - ``sparse_updates``: let recir-embedding turn embedding-table updates into row-wise updates of
      the touched rows (cost grows with the ids in a batch, not the table). Adam/AdamW and weight decay
      then become lazy (FBGEMM's semantics); ``False`` keeps torch.optim's dense maths exactly.
    - ``cache``: use Inductor's FX graph cache and AOTAutograd cache on disk.
    - ``cache_dir``: the Inductor cache folder; ``None`` means ``$TORCHINDUCTOR_CACHE_DIR`` if the
      user set it, else ``$RECIR_CACHE_DIR/inductor`` (default ``~/.cache/recir/inductor``).
    - ``memoize_cpu_isa_probe``: keep the result of Inductor's CPU SIMD probe (it builds and loads a
      test library per ISA in a fresh Python, seconds each, in every process) in ``$RECIR_CACHE_DIR``.
    - ``inductor_config``: extra ``torch._inductor.config`` patches (name -> value), applied last.
    - ``store_rng_masks``: compute each dropout keep mask once and store it (one byte per element)
      instead of letting Inductor recompute its counter hash in every kernel that reads it (the
      forward's and the backward's). The values are the same either way. ``None`` (the default): on for
      steps that recompute activations (recir-recompute-activations), where the kept mask is what a
      layer holds for its backward and Inductor would otherwise keep an int64 stage of the hash, 8 bytes
      per element (full-size DLRMv3 at UIH 4096: 48 instead of 6 MiB per layer); off for other steps:
      on the CPU it is slower there (full-size DLRMv3, bf16, UIH 64: 320 ms/step against 276), and on
      CUDA, where an H200 profile showed the recomputation, it has not been measured yet.
    - ``store_shared_masks``: compute once and store (one byte per element) every boolean value of at least
      64K elements that three or more kernels read, such as an attention mask built once per step and
      read by every layer, forward and backward; Inductor otherwise recomputes its expression inside each
      of them. Same values either way. On by default: full-size DLRMv3 bf16 at UIH 1024 on the CPU device
      956 -> 776 ms/step; not measured on CUDA.
    - ``fused_tbe``: with ``embedding_backend="fbgemm"``, train the tables with FBGEMM's split TBE and its
      fused backward + optimizer outside the compiled graph (the kernel TorchRec trains with): TBE looks
      the rows up, the compiled dense step returns their gradients, TBE's backward updates the rows in
      place. Tables or optimizers FBGEMM cannot fuse, and steps with a sharding plan, keep FBGEMM's
      forward kernel in the graph and the graph's row update (one log line says why). False: always that.
    - ``regions``: ``"whole"`` gives Inductor the step as one graph; ``"repeated"`` cuts it at the
      boundaries of repeated module instances (``layers.0`` .. ``layers.4``, per phase) and compiles each
      distinct piece once (recir.lower_gpu._regions): a cold compile of a model of N identical layers
      lowers one layer's code, not N. Needs ``in_place``; a step it cannot cut compiles whole (logged).
    - ``cpu_matmul``: on the CPU device, which kernel runs the step's fp32 matrix products (``mm``,
      ``addmm`` of at least 4M multiply-adds): ``"onednn"`` (``recir::cpu_matmul``, oneDNN's GEMM),
      ``"aten"`` (Inductor's call of ATen's BLAS, MKL in the PyPI wheels), or ``"auto"`` (the default:
      oneDNN when this torch has it). MKL takes its fast path only on Intel CPUs: on an AMD EPYC
      (AVX-512) oneDNN ran DLRMv3's products 2.1-2.5x faster. bf16/fp16 products and CUDA are unchanged
      (ATen already calls oneDNN, or cuBLAS, for them).
    - ``free_early``: with ``in_place``, free each buffer after its last reader. Inductor orders a state
      update after every kernel that read the old state through dependencies that also keep those
      kernels' outputs alive, so without this every buffer computed from a parameter lives until the
      parameter's update at the end of the backward (recir.lower_gpu._free_early). Same kernels and
      values either way; it matters most for steps that recompute activations (full-size DLRMv3 at UIH
      4096 with ``--recompute layers``: Inductor's buffers peaked at 1283 MiB without it, 759 with it and
      the stored dropout masks, where the step's graph needs 878).
    - ``cpu_variance``: on the CPU device, how Inductor computes a float32 ``var_mean`` (every layer
      norm's statistics) over at most 32K elements: ``"two_pass"`` (the default: the mean, then the sum of
      squared deviations, two plain vectorised sums; recir.lower_gpu._variance) or ``"welford"``
      (Inductor's own Welford reduction, whose per-row lane combine costs more than a short row's
      arithmetic). Same values to float rounding.
    - ``huge_pages_min_bytes``: on the CPU device, back every state tensor of at least this many bytes
      (the large embedding tables) by transparent huge pages (Linux; ``recir.embedding.advise_huge_pages``)
      when ``init_state``/``load_state_dict`` build the state, so a row lookup or update stops paying a TLB
      miss per id. Default 256 MiB; ``None``: never. Same values either way; setup pays about 0.25 s per
      100 MiB advised.
    - ``cpu_sigmoid``: on the CPU device, the exponential in Inductor's vectorised sigmoid (SiLU,
      SwishLayerNorm and their gradients): ``"fast"`` (the default: inline, ``vscalefps`` on AVX-512 and
      ATen's ``exp_u20`` elsewhere; sigmoid within 2.6e-7 / 4.1e-7 relative of float64's, NaN kept) or
      ``"sleef"`` (Inductor's own: a SLEEF call per 16 floats, 1.5e-7); recir.lower_gpu._cpp_codegen.
    - ``cpu_bf16``: on the CPU device, how Inductor's vectorised kernels round float32 to bfloat16:
      ``"native"`` (the default: avx512_bf16's ``vcvtne2ps2bf16``, one instruction per 32 values, where
      Inductor builds for AVX-512 with that extension, else as ``"aten"``) or ``"aten"`` (ATen's integer
      rounding, about 14 instructions). The same bits for every normal value; the instruction flushes
      float32 subnormals to zero; recir.lower_gpu._cpp_codegen.
    - ``aot_autograd``: whether Inductor receives the step through AOTAutograd (``compile_fx``), which
      traces each graph twice through functionalization, or directly (``compile_fx_inner`` after one
      trace through Inductor's decompositions; the decomposed graphs are kept in the cache folder, so a
      cached compile skips the trace too; recir.lower_gpu._direct). A StepGraph is functional ATen
      already, so both give Inductor the same graph. ``None`` (the default): directly on the CPU device,
      through AOTAutograd on CUDA (not measured there yet). Full-size DLRMv3 at UIH 256: the pieces'
      compile 37.4 -> 29.9 s on a 2-core CPU.
    - ``batch_cpu_kernels``: build the C++ kernels of each module Inductor generates as one library (one
      compiler run, one load of the precompiled header, one link) instead of one per kernel
      (recir.lower_gpu._kernel_batches). The same kernel code either way. Full-size DLRMv3 at UIH 256:
      the compiler's CPU time 44 -> 14 s, the cold compile 37.7 -> 25-26 s on a 2-core CPU.
    - ``hstu_attention``: how ``recir::hstu_attention`` and its backward run. ``"inductor"`` (the default)
      inlines their ATen references and Inductor generates the kernels around the products (the score
      tensors of each row block are materialised). ``"triton"`` (CUDA devices only) calls RecIR's fused
      Triton kernels instead, which recompute the scores in registers and never hold them
      (recir.lower_gpu._hstu_triton). They are checked against the references in Triton's interpreter on
      the CPU; they have not yet run or been timed on a GPU, hence not the default.
    """

    mode: InductorMode = "default"
    cuda_graphs: bool | None = None
    in_place: bool = True
    sparse_updates: bool = True
    cache: bool = True
    cache_dir: str | None = None
    memoize_cpu_isa_probe: bool = True
    inductor_config: tuple[tuple[str, Any], ...] = ()
    store_rng_masks: bool | None = None
    store_shared_masks: bool = True
    fused_tbe: bool = True
    regions: Literal["whole", "repeated"] = "whole"
    cpu_matmul: Literal["auto", "onednn", "aten"] = "auto"
    free_early: bool = True
    cpu_variance: Literal["two_pass", "welford"] = "two_pass"
    huge_pages_min_bytes: int | None = 256 << 20  # recir.embedding.HUGE_PAGES_MIN_BYTES
    cpu_sigmoid: Literal["fast", "sleef"] = "fast"
    cpu_bf16: Literal["native", "aten"] = "native"
    aot_autograd: bool | None = None
    batch_cpu_kernels: bool = True
    hstu_attention: Literal["inductor", "triton"] = "inductor"

    def __post_init__(self) -> None:
        if self.hstu_attention not in ("inductor", "triton"):
            raise ConfigError(
                f"GPUOptions.hstu_attention: expected 'inductor' or 'triton', got {self.hstu_attention!r}. "
                "Fix: 'inductor' generates the attention from its ATen reference; 'triton' (CUDA) runs RecIR's "
                "fused Triton kernels."
            )
        if self.mode not in INDUCTOR_MODES:
            raise ConfigError(
                f"GPUOptions.mode: expected one of {INDUCTOR_MODES}, got {self.mode!r}. "
                "Fix: use 'reduce-overhead' for CUDA graphs or 'max-autotune-no-cudagraphs' for GEMM tuning."
            )
        if self.regions not in ("whole", "repeated"):
            raise ConfigError(
                f"GPUOptions.regions: expected 'whole' or 'repeated', got {self.regions!r}. "
                "Fix: 'repeated' compiles each repeated module region once; 'whole' compiles one graph."
            )
        if self.cpu_matmul not in ("auto", "onednn", "aten"):
            raise ConfigError(
                f"GPUOptions.cpu_matmul: expected 'auto', 'onednn' or 'aten', got {self.cpu_matmul!r}. "
                "Fix: 'auto' uses oneDNN's GEMM for fp32 products on the CPU when torch has it; 'aten' keeps "
                "ATen's BLAS call."
            )
        if self.cpu_variance not in ("two_pass", "welford"):
            raise ConfigError(
                f"GPUOptions.cpu_variance: expected 'two_pass' or 'welford', got {self.cpu_variance!r}. "
                "Fix: 'two_pass' computes short CPU variances as two sums; 'welford' keeps Inductor's reduction."
            )
        if self.cpu_sigmoid not in CPU_SIGMOID_MODES:
            raise ConfigError(
                f"GPUOptions.cpu_sigmoid: expected one of {CPU_SIGMOID_MODES}, got {self.cpu_sigmoid!r}. "
                "Fix: 'fast' computes the CPU sigmoid's exponential inline; 'sleef' keeps Inductor's SLEEF call."
            )
        if self.cpu_bf16 not in CPU_BF16_MODES:
            raise ConfigError(
                f"GPUOptions.cpu_bf16: expected one of {CPU_BF16_MODES}, got {self.cpu_bf16!r}. "
                "Fix: 'native' rounds float32 to bfloat16 with avx512_bf16's instruction where the CPU has it; "
                "'aten' keeps ATen's integer rounding."
            )
        if isinstance(self.inductor_config, dict):
            object.__setattr__(self, "inductor_config", tuple(sorted(self.inductor_config.items())))

    def use_cuda_graphs(self, device_type: str) -> bool:
        if device_type != "cuda":
            return False
        return self.mode == "reduce-overhead" if self.cuda_graphs is None else self.cuda_graphs

    def use_aot_autograd(self, device_type: str) -> bool:
        """Whether the compile goes through AOTAutograd on ``device_type`` (``aot_autograd``, resolved)."""
        return self.aot_autograd if self.aot_autograd is not None else device_type != "cpu"

    def inductor_patches(self, device_type: str, pipelined: bool = False) -> dict[str, Any]:
        """The ``torch._inductor.config`` patches these options imply for ``device_type`` (``pipelined``: a
        step with ``carry:`` slots, made by ``recir-pipeline-sparse``)."""
        patches: dict[str, Any] = {"fx_graph_cache": self.cache}
        if pipelined:
            # The next batch's collectives overlap this batch's compute only if their waits stay late;
            # Inductor otherwise schedules each wait right after its collective (measured on 2 gloo ranks:
            # every wait adjacent to its all_to_all). sink_waits moves each wait to just before its first use.
            patches.update(
                reorder_for_compute_comm_overlap=True,
                reorder_for_compute_comm_overlap_passes=["sink_waits"],
            )
        if self.mode == "max-autotune-no-cudagraphs":
            patches.update(max_autotune=True, coordinate_descent_tuning=True)
        # CUDA graphs are ours (the whole step, state at fixed addresses), never Inductor's.
        patches["triton.cudagraphs"] = False
        if device_type == "cpu":
            # The C++ kernels bake in the OpenMP thread count (one thread: no parallel loops at all), but
            # Inductor's cache key leaves it out when `cpp.threads` is -1, so a step compiled in a
            # 1-thread process (the tests) was reused by 2-thread runs and ran serial (measured: full-size
            # DLRMv3 bf16 250-270 against 195 ms/step). Stating the count puts it in the key.
            patches["cpp.threads"] = torch.get_num_threads()
            if self.cpu_variance == "two_pass":
                from ._variance import TwoPassVariance

                patches["post_grad_custom_pre_pass"] = TwoPassVariance()
            patches.update(codegen_patches(self.cpu_sigmoid, self.cpu_bf16))
        from torch._inductor import config as inductor_config

        if self.in_place and self.free_early:
            from ._free_early import FreeEarly

            patches["_pre_fusion_custom_pass"] = FreeEarly()
        if hasattr(inductor_config, "use_pre_grad_passes"):
            # Inductor's pre-grad passes rewrite Dynamo's torch-level graphs (torch.cat, F.linear, modules);
            # a StepGraph is ATen, where they find nothing, yet they ran on every compile, cache hits
            # included (measured: 0.39 s of a 3.9 s cached full-size DLRMv3 compile, graph unchanged).
            patches["use_pre_grad_passes"] = False
        patches.update(dict(self.inductor_config))
        return patches
