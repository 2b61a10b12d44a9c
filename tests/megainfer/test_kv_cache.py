from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.sequence import Sequence


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


def test_the_most_recently_freed_blocks_are_handed_out_first():
    """A stack, so a node touches only as many blocks as it ever held at once (resident memory
    follows the peak use, not the whole lazily mapped cache)."""
    bm = BlockManager(num_blocks=100, block_size=4)
    touched = set()
    for i in range(50):  # many short requests, one after another
        s = Sequence(f"r{i}", [1] * 8, SamplingParams())
        bm.allocate(s, 8)
        touched.update(s.block_table)
        bm.free(s)
    assert touched == {0, 1}
    a, b = Sequence("a", [1] * 12, SamplingParams()), Sequence("b", [1] * 4, SamplingParams())
    bm.allocate(a, 12)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    bm.allocate(b, 4)
    assert b.block_table == [0]
