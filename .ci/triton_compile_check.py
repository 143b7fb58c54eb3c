"""Compile NoiseFormer's Triton kernels (denoised_gpt/noise_kernel.py) for a GPU without one: triton's front end, its
MLIR passes and ptxas (shipped with triton) for an H100 (sm_90), as a launch on that card would. Catches what Triton's
interpreter cannot: types, tile shapes, shared memory. Prints one line per kernel and exits 1 if any fails.

    python3 .ci/triton_compile_check.py          # every dtype, head sizes 64 and 128, every tile of TILES (~10 minutes)
    python3 .ci/triton_compile_check.py --quick  # bfloat16, head size 64, noise per head, each kernel's first tile
"""
import inspect
import os
import sys
import time

os.environ.pop('TRITON_INTERPRET', None)  # compiled kernels, not interpreted ones
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from denoised_gpt import noise_kernel  # noqa: E402

TARGET = GPUTarget('cuda', 90, 32)
KERNELS = {  # kernel: the type of each pointer argument; 'x' stands for the inputs' dtype
    noise_kernel._forward_kernel: dict(Q='x', V='x', O='x', LSE='fp32', SIGMA='fp32', SEED='i64'),
    noise_kernel._backward_query_kernel: dict(Q='x', V='x', O='x', DO='x', LSE='fp32', DELTA='fp32', DQ='fp32',
                                              SIGMA='fp32', SEED='i64'),
    noise_kernel._backward_key_kernel: dict(Q='x', V='x', DO='x', LSE='fp32', DELTA='fp32', DQ='fp32', DQ_OUT='x',
                                            DV='x', DSIGMA='fp32', SIGMA='fp32', SEED='i64'),
}


def source(kernel, pointers, dtype, constexprs):
    signature = {name: 'constexpr' if name in constexprs else
                 ('*' + (dtype if pointers[name] == 'x' else pointers[name])) if name in pointers else
                 'fp32' if name == 'scale' else 'i32' for name in kernel.arg_names}
    if 'constexprs' in inspect.signature(ASTSource).parameters:  # triton 3.3 and newer
        return ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    return ASTSource(kernel, signature, constants=constexprs)  # triton 3.2


def main(quick):
    cases = [('bf16', 64, 12, False)] if quick else \
        [(dtype, head_size, noise_heads, per_sample) for dtype in ('bf16', 'fp16', 'fp32') for head_size in (64, 128)
         for noise_heads, per_sample in ((12, False), (1, True))]
    failed = tried = 0
    for dtype, head_size, noise_heads, per_sample in cases:
        for kernel, pointers in KERNELS.items():
            for tile in noise_kernel.TILES[kernel][:1 if quick else None]:
                constexprs = dict(NOISE_HEADS=noise_heads, PER_SAMPLE=per_sample, BLOCK_D=head_size,
                                  PRECISION='ieee' if dtype == 'fp32' else 'tf32', **tile.kwargs)
                what = (f"{kernel.__name__} {dtype} head size {head_size}, {noise_heads} noise heads, per sample "
                        f"{per_sample}, {tile.kwargs['BLOCK_M']} x {tile.kwargs['BLOCK_N']} tiles, {tile.num_warps} "
                        f"warps, {tile.num_stages} stages")
                start, tried = time.time(), tried + 1
                try:
                    compiled = triton.compile(source(kernel, pointers, dtype, constexprs), target=TARGET,
                                              options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
                except Exception as e:  # any compiler error is the finding: say which kernel, and go on
                    failed += 1
                    print(f"FAILED {what}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
                    continue
                print(f"ok {what}: {compiled.metadata.shared // 1024} KiB shared memory, {time.time() - start:.1f} s")
    print(f"triton {triton.__version__}, sm_{TARGET.arch}: {failed} of {tried} failed")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main('--quick' in sys.argv[1:]))
