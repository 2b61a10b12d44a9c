from megainfer.kv_cache import BlockManager
from megainfer.sampling_params import SamplingParams
from megainfer.sequence import Sequence


def test_allocate_grows_table_by_block_and_free_returns_all():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = Sequence("a", [1] * 5, SamplingParams())
    assert bm.num_new_blocks(s, 5) == 2
    bm.allocate(s, 5)
    s.num_computed_tokens = 5
    assert len(s.block_table) == 2 and bm.num_free_blocks == 8
    assert bm.num_new_blocks(s, 3) == 0  # positions 5..7 fit the second block
    assert bm.num_new_blocks(s, 4) == 1
    assert abs(bm.usage - 0.2) < 1e-9
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == [] and bm.usage == 0.0


def test_can_allocate_refuses_beyond_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = Sequence("a", [1] * 12, SamplingParams())
    assert not bm.can_allocate(s, 12)
    assert bm.can_allocate(s, 8)
