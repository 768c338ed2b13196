"""The engine tier's tiny models (`cli.engines.model`): a redraw changes exactly the named parameters.

Needs transformers and safetensors (the vLLM environment), hence ``-m vllm``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("transformers")


def _weights(path: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(str(path / "model.safetensors")))


def test_redraw_changes_only_the_named_parameters(tmp_path: Path) -> None:
    import torch

    from ascend_dist.cli.engines.model import write_model

    base = _weights(write_model(tmp_path / "a", seed=3, num_layers=2))
    same = _weights(write_model(tmp_path / "a2", seed=3, num_layers=2))
    attention = "model.layers.1.self_attn."
    other = _weights(write_model(tmp_path / "b", seed=3, num_layers=2, redraw=attention, redraw_seed=4))
    assert all(torch.equal(base[k], same[k]) for k in base)  # control: the same seed writes the same bytes
    changed = sorted(k for k in base if not torch.equal(base[k], other[k]))
    assert changed == sorted(k for k in base if k.startswith(attention))
    assert len(changed) == 4  # q, k, v, o


def test_redraw_of_nothing_is_refused(tmp_path: Path) -> None:
    from ascend_dist.cli.engines.model import write_model

    with pytest.raises(ValueError, match="no parameter starts with"):
        write_model(tmp_path / "x", seed=3, num_layers=1, redraw="model.layers.9.")
