"""study.py's design claims that can be checked without running the study."""

import pytest

import study


@pytest.mark.parametrize('name', [m for m in study.MODELS if m != 'grt_deep'])
def test_study_models_match_dense_training_flops(name):
    """isoFLOP and ladder runs cost the dense model's training FLOPs per token (within 3.5%)."""
    dense = study.train_flops_per_token(study.model_of('gpt'))
    assert abs(study.train_flops_per_token(study.model_of(name)) / dense - 1) < 0.035


def test_isoparam_model_matches_dense_unique_blocks():
    dense, deep = study.model_of('gpt'), study.model_of('grt_deep')
    assert deep.config.n_layer == dense.config.n_layer  # 1 + 4 + 1 unique blocks against 6 layers
    assert deep.num_block_passes(deep.config.n_recur) > dense.config.n_layer  # deeper at the same blocks


def test_every_section_names_known_models():
    for runs in study.SECTIONS.values():
        assert all(model in study.MODELS for model, _ in runs)
    assert study.LADDER[-1] == 'grt' and [study.MODELS[m].get('rung', 5) for m in study.LADDER] == [1, 2, 3, 4, 5]
