"""Where the quantized kernel's row limits should sit on this CPU: the kernel against the dense GEMM
over the dequantized weight (``backends/dense_gemm.py``'s: oneDNN's for float32, and for bfloat16
with ``--dtype`` oneDNN's on AMX CPUs, the AVX2 bf16 GEMM on CPUs with AVX2 alone), per row count,
over the default model's own matrices (the 30 layers' Q4_1 ones, and the Q8_0 LM head apart: 8-bit
codes cost the kernel twice the work).

Prints the milliseconds (median of the repeats) of each path at each row count; the kernel should
take the rows where its column is the smaller (``quantization/packed.py: _AVX2_KERNEL_ROWS`` and
``_AVX2_KERNEL_ROWS_8_BIT``, ``_AVX2_BF16_KERNEL_ROWS`` and ``_AMX_KERNEL_ROWS`` for bfloat16). A benchmark, never a
test; needs the kernel (an x86 CPU with AVX2).

    python benchmarks/quant_row_limit.py [--rows 1,2,4,8,16,32 --repeats 5 --num-threads 2 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from cpu_kernels import median_ms  # this folder's: the same timing as the other kernels'
from gguf import GGUFReader

from cadence.models.loader import default_model_path
from cadence.quantization import ggml, packed
from cadence.quantization.packed import QuantizedMatrix, dense_linear, kernel_linear, pack


def load_matrices(path: str) -> tuple[list[QuantizedMatrix], QuantizedMatrix]:
    """The file's quantized 2-D tensors as the kernel packs them: the layers' and the embedding (the tied head)."""
    layers, head = [], None
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) != 2 or tensor.tensor_type not in ggml.DECODERS:
            continue
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8).reshape(rows, -1)
        matrix = pack(ggml.decode(raw, tensor.tensor_type, cols))
        if tensor.name == "token_embd.weight":
            head = matrix
        else:
            layers.append(matrix)
    assert head is not None, "no token_embd.weight in the file"
    return layers, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,3,4,8,12,16,20,24,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.num_threads)
    if not packed.kernel_available():
        raise SystemExit("no quantized kernel here (it needs an x86 CPU with AVX2)")
    layers, head = load_matrices(default_model_path())
    for m in [*layers, head]:
        m.dense(dtype)  # dequantized once, as the engine's warm-up does
    print(f"{len(layers)} layer matrices ({layers[0].bits}-bit); LM head {head.rows} x {head.cols}, {head.bits}-bit")
    print("rows | layers: kernel | dense | head: kernel | dense (ms)")
    for count in (int(r) for r in args.rows.split(",")):
        times = row_times(layers, head, count, args.repeats, dtype)
        print(f"{count} | " + " | ".join(f"{t:.1f}" for t in times), flush=True)


def row_times(layers: list[QuantizedMatrix], head: QuantizedMatrix, count: int, repeats: int,
              dtype: torch.dtype) -> list[float]:
    """Milliseconds of ``count`` rows of ``dtype`` through the layers (kernel, dense), then the head (the same)."""
    inputs = {cols: torch.randn(count, cols, dtype=dtype) for cols in {m.cols for m in [*layers, head]}}

    def every_layer(path: Callable[[torch.Tensor, QuantizedMatrix, None], torch.Tensor]) -> None:
        for m in layers:
            path(inputs[m.cols], m, None)

    x = inputs[head.cols]
    return [median_ms(lambda: every_layer(kernel_linear), repeats),
            median_ms(lambda: every_layer(dense_linear), repeats),
            median_ms(lambda: kernel_linear(x, head, None), repeats),
            median_ms(lambda: dense_linear(x, head, None), repeats)]


if __name__ == "__main__":
    main()
