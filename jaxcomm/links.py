"""Link specs: the bandwidth and latency a device sees on one mesh axis.

A :class:`Link` is the two numbers of the alpha-beta model, ``alpha = latency_s`` (seconds per
message step) and ``beta = 1 / bandwidth_bytes_per_s`` (seconds per byte), seen by *one
device* sending in *one direction*: a ring collective sends and receives at the same time,
so the time to push ``B`` bytes out of a device is ``alpha + B beta``.

Presets (bandwidth per direction; latency per ring step):

================  ==============  =========  ===============================================
name              bandwidth       latency    source
================  ==============  =========  ===============================================
``nvlink4``       450 GB/s        3.4 us     H100 NVLink 4: 18 links x 25 GB/s per direction;
                                             NVIDIA's "900 GB/s" counts both directions.
                                             Latency: NCCL's ring/Simple per-step NVLink
                                             latency (``hwLat`` in ``src/graph/tuning.cc``).
``pcie5``         64 GB/s         5.7 us     PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b
                                             (63 GB/s) per direction. Latency: NCCL's ring/
                                             Simple per-step PCI latency (same table).
``ib-hdr``        25 GB/s         14 us      InfiniBand HDR, 200 Gbit/s per port. Latency:
                                             NCCL's ring/Simple per-step network latency
                                             (same table).
``100gbe``        12.5 GB/s       25 us      100 Gbit/s Ethernet with kernel TCP (gloo,
                                             NCCL sockets): NIC + switch + two kernel stacks.
``10gbe``         1.25 GB/s       30 us      as above, plus 1.2 us to serialize a 1500-byte
                                             frame at each of two hops (NIC, switch).
``1gbe``          0.125 GB/s      50 us      as above; serializing a 1500-byte frame takes
                                             12 us per hop at 1 Gbit/s.
================  ==============  =========  ===============================================

The Ethernet latencies are estimates (one-way small-message TCP latency through one switch);
for gradient-sized messages the bandwidth term dominates, and for a real cluster a
ping-pong or ``nccl-tests`` run gives better numbers: build ``Link(name, bandwidth,
latency)`` from them. A preset is *per device*: when the ``G`` devices of a host share one
NIC, use ``link('1gbe').shared_by(G)``.
"""

from jaxcomm._src.links import (Link, NVLINK4, PCIE5, IB_HDR, ETHERNET_100G, ETHERNET_10G,
                                ETHERNET_1G, PRESETS, link)

__all__ = [
    "Link", "NVLINK4", "PCIE5", "IB_HDR", "ETHERNET_100G", "ETHERNET_10G", "ETHERNET_1G",
    "PRESETS", "link",
]
