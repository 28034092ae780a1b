"""The CPU tier's registry entry round trips: what the launcher writes is what workers and ranks read."""

import pytest

from hkv.ipc import tier_regions
from hkv.ipc.shm import Registry, ShmRegion
from hkv.storage.host_pool import HostLayout

from tests.shm_helpers import fresh_instance

LAYOUT = HostLayout(num_pages=3, state_units=1, kv_layers=1, page_size=2, kv_heads=1, head_dim=4, kv_dtype="float32",
                    lin_layers=1, conv_dim=2, conv_width=1, v_heads=1, k_dim=2, v_dim=2)
ROOT = bytes(range(16))


@pytest.fixture
def instance():
    yield from fresh_instance("tr")


def test_pool_layout_and_attach_pool_read_back_the_launchers_entry(instance):
    with Registry.create(instance, capacity=4) as registry:
        created = ShmRegion.create(instance, tier_regions.TIER_REGION, LAYOUT.nbytes, writer="cache_worker")
        registry.add(tier_regions.TIER_REGION, writer="cache_worker", version=tier_regions.VERSION,
                     layout=tier_regions.registry_layout(LAYOUT, ROOT))
        assert tier_regions.pool_layout(instance) == (LAYOUT, ROOT)
        region, layout, root = tier_regions.attach_pool(instance)
        try:
            assert (layout, root) == (LAYOUT, ROOT) and region.payload.nbytes >= LAYOUT.nbytes
            region.payload[0] = 7  # writable: ranks copy entry contents into it
            assert created.payload[0] == 7
        finally:
            region.close()
            created.close()
