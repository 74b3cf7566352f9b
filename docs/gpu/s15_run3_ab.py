"""GPU A/B of the accelerator formulations (session 15): which one slows chunked top-k."""
import sys, time
import jax, jax.numpy as jnp
from benchmarks.compressors import roundtrip, time_calls
import jaxcomm
from jaxcomm._src.compress import select

n = 1 << 28
x = jax.random.normal(jax.random.PRNGKey(0), (n,))
print("backend", jax.default_backend(), flush=True)
cumsum, accel_kth = select._cumsum, select.accelerator_kth

def radix_rows(bits, k):
  if bits.ndim == 2 and bits.shape[0] > 1:
    return select._radix_kth(bits, k)
  return accel_kth(bits, k)

variants = {"current": (cumsum, accel_kth), "kth2d-radix": (cumsum, radix_rows),
            "scan-prefix": (select._scan_sum, accel_kth), "both": (select._scan_sum, radix_rows)}
for name in sys.argv[1].split(";"):
  for label, (prefix, kth) in variants.items():
    select._cumsum, select.accelerator_kth = prefix, kth
    c = eval("jaxcomm.compress." + name)
    t0 = time.perf_counter()
    [(seconds, cpu)] = time_calls([roundtrip(c, [x])], 5)
    print(f"{name:28s} {label:12s} {4 * n / seconds / 1e9:8.1f} GB/s  {seconds * 1e3:7.2f} ms  host {cpu * 1e3:5.1f} ms  (incl. compile {time.perf_counter() - t0:4.1f} s)", flush=True)
select._cumsum, select.accelerator_kth = cumsum, accel_kth
c = jaxcomm.compress.count_sketch(16384, 5, heavy=0.01)
[(seconds, cpu)] = time_calls([roundtrip(c, [x])], 5)
print(f"count_sketch accelerator path {4 * n / seconds / 1e9:8.1f} GB/s {seconds * 1e3:7.2f} ms host {cpu * 1e3:5.1f} ms", flush=True)
