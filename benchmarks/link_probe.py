"""link_probe: does the emulated slow link starve a sparse flow while bulk traffic fills it?

The coordination service's heartbeat (a small gRPC every few seconds) shares
:mod:`benchmarks.slow_link`'s veth pair with the collectives. This sets up the same two
network namespaces and ``tc tbf`` limit, saturates the link in both directions with one bulk
TCP stream each way (as an all-reduce does), and meanwhile times a 60-byte request/response
on its own TCP connection every 100 ms from host 1 to host 0 (the heartbeat's direction).
It prints the probe's latency quantiles and each veth end's bytes sent and packets dropped
by the qdisc. Needs root, ``ip`` and ``tc``; the namespaces are removed at the end.

Run ``python -m benchmarks.link_probe --rate 100mbit --seconds 20``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from benchmarks import slow_link

_PROBE_BYTES = 60

_SERVER = r"""
import socket, sys, threading
def sink(c):
  while c.recv(1 << 20): pass
def echo(c):
  while True:
    data = c.recv(64)
    if not data: return
    c.sendall(data)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
while True:
  c, _ = s.accept()
  threading.Thread(target=sink if c.recv(1) == b"B" else echo, args=(c,), daemon=True).start()
"""

_BULK = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.sendall(b"B")
block, end = b"x" * (1 << 20), time.time() + float(sys.argv[3])
while time.time() < end: s.sendall(block)
"""

_PROBE = r"""
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); s.sendall(b"E")
size, seconds, end = int(sys.argv[4]), [], time.time() + float(sys.argv[3])
while time.time() < end:
  start = time.perf_counter(); s.sendall(b"h" * size); received = 0
  while received < size: received += len(s.recv(64))
  seconds.append(time.perf_counter() - start); time.sleep(0.1)
print(json.dumps(seconds))
"""


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rate", default="100mbit", help="tbf rate on both veth ends")
  parser.add_argument("--seconds", type=float, default=20.0, help="how long the probe runs")
  return parser.parse_args(argv)


def _in(namespace: str, script: str, *args) -> list[str]:
  return ["ip", "netns", "exec", namespace, sys.executable, "-c", script, *map(str, args)]


def _qdisc_counts(namespace: str, device: str) -> tuple[int, int]:
  """Bytes sent and packets dropped by ``device``'s root qdisc."""
  stats = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev",
                          device], capture_output=True, text=True, check=True).stdout
  sent = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", stats)
  return int(sent.group(1)), int(sent.group(2))


def probe(rate: str, seconds: float) -> dict:
  """Latencies (seconds) of the probe and the qdiscs' counts under bulk traffic at ``rate``."""
  port, servers, bulk = slow_link.PORT, [], []
  with slow_link.emulated_link():
    slow_link.set_rate(rate)
    try:
      servers = [subprocess.Popen(_in(ns, _SERVER, address, port))
                 for ns, address in zip(slow_link.NAMESPACES, slow_link.ADDRESSES)]
      time.sleep(1.0)
      for ns, peer in zip(slow_link.NAMESPACES, reversed(slow_link.ADDRESSES)):
        bulk.append(subprocess.Popen(_in(ns, _BULK, peer, port, seconds + 2.0)))
      time.sleep(1.0)
      started = time.time()
      out = subprocess.run(_in(slow_link.NAMESPACES[1], _PROBE, slow_link.ADDRESSES[0], port,
                               seconds, _PROBE_BYTES), capture_output=True, text=True,
                           check=True)
      for process in bulk:
        process.wait()
      elapsed = time.time() - started + 1.0
      counts = [_qdisc_counts(ns, dev) for ns, dev in zip(slow_link.NAMESPACES, slow_link.VETH)]
    finally:
      for process in servers + bulk:
        process.kill()
  return {"latencies": sorted(json.loads(out.stdout)), "counts": counts, "elapsed": elapsed}


def main(argv=None) -> None:
  args = parse_args(argv)
  reason = slow_link.slow_link_unavailable()
  if reason:
    print(f"link_probe skipped: {reason}")
    return
  result = probe(args.rate, args.seconds)
  lat = result["latencies"]
  at = lambda q: 1e3 * lat[min(len(lat) - 1, int(q * len(lat)))]
  print(f"{args.rate}, both directions saturated by one bulk TCP stream each, "
        f"{len(lat)} probes of {_PROBE_BYTES} B every 100 ms:")
  print(f"  probe round trip: median {at(0.5):.1f} ms, p90 {at(0.9):.1f}, p99 {at(0.99):.1f}, "
        f"max {1e3 * lat[-1]:.1f}")
  for host, (sent, dropped) in enumerate(result["counts"]):
    print(f"  host {host} sent {sent / 1e6:.0f} MB ({8 * sent / result['elapsed'] / 1e6:.0f} "
          f"Mbit/s over the bulk streams' {result['elapsed']:.0f} s), qdisc drops {dropped}")


if __name__ == "__main__":
  main()
