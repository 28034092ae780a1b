"""The CPU tier's shared-memory regions: the page pool and the cache worker's stats block.

    cpu_tier  page-size units holding pages and checkpoints (hkv/storage/host_pool.py). The launcher
              creates it; the cache worker decides which entry holds what, ranks copy
              entry contents and the worker reads and writes them for the disk tier.
              Its registry entry carries the HostLayout and the fingerprint root key.
    tiers     the worker's CPU and disk tier figures, a json_block. Writer: the cache
              worker. Readers: the api (/metrics) and hkv-inspect.
    pd        prefill/decode modes: the transporter's figures (frames rejected by reason,
              transfers, pages moved), a json_block. Writer: the transporter.

The launcher writes the registry entry (`registry_layout`); the worker, the
router and the ranks read it back (`pool_layout`, `attach_pool`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hkv.ipc.shm import Registry, ShmRegion

if TYPE_CHECKING:
    from hkv.storage.host_pool import HostLayout

TIER_REGION = "cpu_tier"
TIER_STATS_REGION = "tiers"
TIER_STATS_NBYTES = 64 * 1024
PD_STATS_REGION = "pd"  # prefill/decode: the transporter's figures, a json_block (hkv/actors/transporter.py)
PD_STATS_NBYTES = 16 * 1024
PD_STATS_VERSION = 1  # its document's layout (hkv-inspect reads this one)
VERSION = 3  # 2: one budget of units (HostLayout.state_units), no fixed page/checkpoint split; 3: the drafter's part


def registry_layout(layout: HostLayout, fingerprint: bytes) -> dict:
    """The pool's registry layout document: the HostLayout's fields and the fingerprint, hex."""
    return {**layout.to_dict(), "fingerprint": fingerprint.hex()}


def pool_layout(instance: str) -> tuple[HostLayout, bytes]:
    """The CPU tier's layout and fingerprint root key, from the instance's registry."""
    # imported here: the api and hkv-inspect use this module for the region names and never load torch
    from hkv.storage.host_pool import HostLayout

    with Registry.attach(instance, readonly=True) as registry:
        entry = next(e for e in registry.entries() if e.region == TIER_REGION)
    layout_doc = dict(entry.layout)
    fingerprint = bytes.fromhex(layout_doc.pop("fingerprint"))
    return HostLayout(**layout_doc), fingerprint


def attach_pool(instance: str) -> tuple[ShmRegion, HostLayout, bytes]:
    """Map the CPU tier's page pool, writable: (region, layout, fingerprint root key); the caller closes it."""
    layout, fingerprint = pool_layout(instance)
    region = ShmRegion.attach(instance, TIER_REGION, readonly=False)
    return region, layout, fingerprint
