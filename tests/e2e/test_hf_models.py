"""AioPersistCallback writes a model as ``save_pretrained`` writes it, whatever the model:
the same files and the same tensors under the same names as a stock Trainer's checkpoint
(plus aiopersist's manifest) for models whose saved form is not their in-memory state
dict. Each is trained one step stock and with the callback, from the same seed, offline,
the models built from configs. Found by running transformers' own Trainer checkpoint
tests with the callback added, and models beyond them."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402

from aiopersist.integrations.transformers import AioPersistCallback  # noqa: E402
from tests._launch import run  # noqa: E402
from tests.conftest import BACKENDS  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _checkpoint(out: Path, make: Callable[[], Any], data: list[dict[str, Any]], backend: str | None) -> Path:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    callbacks = [] if backend is None else [AioPersistCallback(backend=backend)]
    Trainer(model=make(), args=args, train_dataset=data, callbacks=callbacks).train()
    return out / "checkpoint-1"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def _assert_as_stock(stock: Path, ours: Path) -> None:
    assert sorted(os.listdir(ours)) == sorted([*os.listdir(stock), "aiopersist.json"])
    for name in os.listdir(stock):
        if name.endswith(".safetensors"):
            want, got = _tensors(stock / name), _tensors(ours / name)
            assert sorted(got) == sorted(want), name
            assert all(torch.equal(got[k], want[k]) for k in want), name
        elif name.endswith((".json", ".py")) and name != "trainer_state.json":
            assert (ours / name).read_bytes() == (stock / name).read_bytes(), name


def _tokens(vocab: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, vocab, (8, 8))]


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(config)


def _marian() -> Any:
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return MarianMTModel(config)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "model",
    [
        # transformers 5 fuses a Mixtral's experts in memory; save_pretrained writes them
        # back per expert (block_sparse_moe.experts.N.w1...), as the original checkpoints.
        "mixtral",
        # Marian's sinusoidal position tables are _keys_to_ignore_on_save.
        "marian",
    ],
)
def test_weights_are_those_save_pretrained_writes(tmp_path: Path, backend: str, model: str) -> None:
    make, data = {"mixtral": (_mixtral, _tokens(64)), "marian": (_marian, _tokens(64))}[model]
    stock = _checkpoint(tmp_path / "stock", make, data, None)
    ours = _checkpoint(tmp_path / "ours", make, data, backend)
    _assert_as_stock(stock, ours)
    if model == "mixtral":
        assert any(".experts.0.w1." in k for k in _tensors(ours / "model.safetensors"))
    else:
        assert not any("embed_positions" in k for k in _tensors(ours / "model.safetensors"))


_CUSTOM = """
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel


class TinyConfig(PreTrainedConfig):
    model_type = "aiopersist-tiny-custom"

    def __init__(self, n=4, tie_word_embeddings=True, **kw):
        self.n = n
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kw)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    _tied_weights_keys = {"head.weight": "embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        # The alias comes first in the state dict: save_pretrained keeps the source name.
        self.head = nn.Linear(config.n, 16, bias=False)
        self.embed = nn.Embedding(16, config.n)
        self.post_init()

    def forward(self, input_ids, labels=None, **kw):
        logits = self.head(self.embed(input_ids))
        return (nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_custom_code_model_is_saved_with_its_code_and_auto_map(tmp_path: Path, backend: str) -> None:
    """A model registered with ``register_for_auto_class`` (as every model loaded with
    ``trust_remote_code=True`` is): its code file and ``auto_map`` in ``config.json``, so
    ``AutoModel.from_pretrained(checkpoint, trust_remote_code=True)`` loads it; its tied
    weights under the name ``save_pretrained`` keeps."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "modeling_aiopersist_tiny.py").write_text(textwrap.dedent(_CUSTOM))
    sys.path.insert(0, str(src))
    try:
        import modeling_aiopersist_tiny as mod  # type: ignore[import-not-found]

        mod.TinyConfig.register_for_auto_class()
        mod.TinyModel.register_for_auto_class("AutoModel")
        data = _tokens(16)
        stock = _checkpoint(tmp_path / "stock", lambda: mod.TinyModel(mod.TinyConfig()), data, None)
        ours = _checkpoint(tmp_path / "ours", lambda: mod.TinyModel(mod.TinyConfig()), data, backend)
    finally:
        sys.path.remove(str(src))
        sys.modules.pop("modeling_aiopersist_tiny", None)
    _assert_as_stock(stock, ours)
    assert "modeling_aiopersist_tiny.py" in os.listdir(ours)
    assert set(json.loads((ours / "config.json").read_text())["auto_map"]) == {"AutoConfig", "AutoModel"}
    assert sorted(_tensors(ours / "model.safetensors")) == ["embed.weight"]
    verify = run([sys.executable, "-m", "aiopersist", "verify", str(ours)], text=True)
    assert verify.returncode == 0, verify.stderr
    load = (
        "from transformers import AutoModel; "
        f"m = AutoModel.from_pretrained({str(ours)!r}, trust_remote_code=True); print(type(m).__name__)"
    )
    proc = run(
        [sys.executable, "-c", load],
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("TinyModel")
