"""Dropout masks belong to samples, not to the process or micro-batch that computes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.dropout import SampleDropout, batch_context, mask_key, raw_slice, u16_slice


def uniform_slice(key: int, start: int, count: int) -> np.ndarray:
    """The stream's draws as uniform floats in [0, 1) (53 bits), for the checks below."""
    return (raw_slice(key, start, count) >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def test_a_slice_of_the_stream_equals_the_stream_sliced():
    key = mask_key(1, 2, 3)
    whole = uniform_slice(key, 0, 1000)
    for start, count in [(0, 7), (1, 10), (3, 5), (4, 4), (997, 3), (250, 500)]:
        assert np.array_equal(uniform_slice(key, start, count), whole[start:start + count])
    assert 0.0 <= whole.min() and whole.max() < 1.0
    assert abs(whole.mean() - 0.5) < 0.05
    assert not np.array_equal(uniform_slice(mask_key(1, 2, 4), 0, 1000), whole)  # another layer: another mask
    assert not np.array_equal(uniform_slice(mask_key(1, 3, 3), 0, 1000), whole)  # another step
    assert not np.array_equal(uniform_slice(mask_key(2, 2, 3), 0, 1000), whole)  # another seed


def test_16_bit_draws_slice_like_the_whole_stream():
    key = mask_key(7, 11, 0)
    whole = u16_slice(key, 0, 4099)
    for start, count in [(0, 1), (1, 3), (3, 2), (4, 17), (13, 4000), (4098, 1)]:
        assert np.array_equal(u16_slice(key, start, count), whole[start:start + count])
    assert abs(whole.mean() / 2**16 - 0.5) < 0.02


def test_a_negative_layer_id_is_refused():
    with pytest.raises(ValueError, match="layer_id"):
        SampleDropout(0.1, layer_id=-1)


def test_mask_keys_are_distinct_across_seeds_steps_and_layers():
    keys = {mask_key(seed, step, layer) for seed in range(4) for step in range(200) for layer in range(8)}
    assert len(keys) == 4 * 200 * 8


def test_masks_do_not_depend_on_how_the_batch_is_split():
    layer = SampleDropout(0.5, layer_id=0).train()
    x = torch.ones(12, 3, 4)
    with batch_context(seed=5, step=9, offset=0, global_batch=12):
        whole = layer(x)
    parts = []
    for offset, size in [(0, 5), (5, 4), (9, 3)]:  # three processes, uneven shards
        with batch_context(seed=5, step=9, offset=offset, global_batch=12):
            parts.append(layer(x[offset:offset + size]))
    assert torch.equal(torch.cat(parts), whole)
    kept = (whole > 0).float().mean().item()
    assert 0.3 < kept < 0.7 and torch.allclose(whole[whole > 0], torch.tensor(2.0))
    assert torch.equal(layer.eval()(x), x)
