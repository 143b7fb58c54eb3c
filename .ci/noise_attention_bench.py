"""Attention alone, forward + backward, at GPT-2 small's shape on a GPU: base's causal SDPA (flash), NoiseFormer's SDPA
path (the noise drawn by causal_randn, a (1, H, T, T) mask, NoiseScoreGradient) and its Triton kernel, v1 and v2.
Where bench.py times whole steps, this says what the attention itself costs, and which tiles the autotuner chose.

    python3 .ci/noise_attention_bench.py                    # B 12, H 12, T 1024, d 64, bfloat16, CUDA
    TRITON_INTERPRET=1 python3 .ci/noise_attention_bench.py --device=cpu --B=1 --H=2 --T=40 --d=16 --iters=1
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from denoised_gpt import noise_kernel  # noqa: E402
from model import causal_attention, causal_attention_learned_noise, causal_randn  # noqa: E402


def timed(fn, device, iters):
    """Median seconds of fn() over iters calls after 3 warm-up calls, and the peak memory it allocated beyond
    what was allocated before (CUDA only)."""
    for _ in range(3):
        fn()
    cuda = device.startswith('cuda')
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return sorted(times)[len(times) // 2], peak


def main():
    p = argparse.ArgumentParser()
    for name, default in (('B', 12), ('H', 12), ('T', 1024), ('d', 64), ('iters', 20)):
        p.add_argument(f'--{name}', type=int, default=default)
    p.add_argument('--device', default='cuda')
    p.add_argument('--dtype', default='bfloat16')
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    # q and v as model.py's split_heads leaves them: (B, T, H, d) memory seen as (B, H, T, d)
    qv = torch.randn(a.B, a.T, 2, a.H, a.d, device=a.device, dtype=dtype)
    q, v = (t.squeeze(2).transpose(1, 2).detach().requires_grad_() for t in qv.split(1, dim=2))
    grad = torch.randn(a.B, a.H, a.T, a.d, device=a.device, dtype=dtype)
    results = []
    for noise_heads in (a.H, 1):
        mu = torch.zeros(noise_heads, device=a.device, requires_grad=True)
        sigma = torch.full((noise_heads,), 0.5, device=a.device, requires_grad=True)
        version = 'v2' if noise_heads > 1 else 'v1'

        def sdpa_path():
            eps = causal_randn((1, noise_heads, a.T, a.T), device=a.device, dtype=dtype)
            causal_attention_learned_noise(q, q, v, mu, sigma, eps).backward(grad)

        def kernel():
            noise_kernel.noise_attention(q, v, mu, sigma, False).backward(grad)

        results += [(f'noiseformer_{version} SDPA path', *timed(sdpa_path, a.device, a.iters)),
                    (f'noiseformer_{version} Triton kernel', *timed(kernel, a.device, a.iters))]
    results.insert(0, ('base (causal SDPA)', *timed(lambda: causal_attention(q, q, v).backward(grad), a.device,
                                                   a.iters)))
    print(f"attention forward + backward, B {a.B}, H {a.H}, T {a.T}, d {a.d}, {a.dtype}, {a.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if a.device.startswith('cuda') else ''}, median of {a.iters}")
    base_time = results[0][1]
    for name, seconds, peak in results:
        print(f"  {name:34s} {seconds * 1e3:8.3f} ms  {seconds / base_time:5.2f}x base  peak +{peak / 2**20:7.1f} MiB")
    for kernel, tuner in noise_kernel._tuned.items():  # the tiles the autotuner chose, per (T, d, dtype)
        for key, config in getattr(tuner, 'cache', {}).items():
            print(f"  {kernel.__name__} {key}: {config}")


if __name__ == '__main__':
    main()
