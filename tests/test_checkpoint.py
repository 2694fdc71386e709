"""HF safetensors folders: transformers loads what Miles saves; writes are atomic."""

import pytest
import torch

from miles_core.models.checkpoint import atomic_dir, load_hf_folder, save_hf_folder
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.plugins.manager import MilesPlugins


def _saved_llama(ckpt, seed: int | None = None):
    """A tiny random llama saved as an HF folder at ``ckpt``; the registries it was saved with."""
    regs = MilesPlugins(autoload=False).registries
    if seed is not None:
        torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    save_hf_folder(model, regs.model_families.get("llama"), ckpt)
    return regs


@pytest.mark.parametrize("family,qk_norm", [("llama", False), ("qwen3", True)])
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, family, qk_norm):
    transformers = pytest.importorskip("transformers")
    regs = MilesPlugins(autoload=False).registries
    fam = regs.model_families.get(family)
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, qk_norm=qk_norm))
    save_hf_folder(model, fam, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    ids = torch.randint(0, 50, (2, 9))
    ours = model.lm_head(model(ids))
    theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    back, fam2 = load_hf_folder(tmp_path / "ckpt", regs.model_families)
    assert fam2.name == family
    torch.testing.assert_close(back.lm_head(back(ids)), ours)


def test_atomic_dir_keeps_the_old_folder_when_a_write_fails(tmp_path):
    dest = tmp_path / "ckpt"
    atomic_dir(dest, lambda d: (d / "a.txt").write_text("v1"))

    def broken(d):
        (d / "a.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_dir(dest, broken)
    assert (dest / "a.txt").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left behind


def test_atomic_dir_puts_the_old_folder_back_when_the_final_rename_fails(tmp_path, monkeypatch):
    """The old folder is moved aside, then the new one moved in; if that second rename fails, the old one
    returns. (A failing rename cannot be produced on demand here: ``os.replace`` is made to fail once.)"""
    import os

    dest = tmp_path / "ckpt"
    atomic_dir(dest, lambda d: (d / "a.txt").write_text("v1"))
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("device busy")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="device busy"):
        atomic_dir(dest, lambda d: (d / "a.txt").write_text("v2"))
    monkeypatch.setattr(os, "replace", real)
    assert len(calls) == 3  # aside, in (failed), back
    assert (dest / "a.txt").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    atomic_dir(dest, lambda d: (d / "a.txt").write_text("v3"))  # and the next write replaces it
    assert (dest / "a.txt").read_text() == "v3" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_truncated_safetensors_file_is_named(tmp_path):
    from miles_core.errors import ConfigError

    regs = _saved_llama(tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"'{f}' is not a readable safetensors file"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)


def test_a_folder_that_does_not_match_its_config_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from miles_core.errors import ConfigError

    regs = MilesPlugins(autoload=False).registries
    fam = regs.model_families.get("llama")
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_folder(tmp_path / "nowhere", regs.model_families)
    model = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                  intermediate_size=64, tie_word_embeddings=False))
    save_hf_folder(model, fam, tmp_path / "ckpt", extra_files={"tokenizer.json": "{}"})
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == "{}"
    f = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(f))
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(f))  # untied: the head is needed
    with pytest.raises(ConfigError, match=r"does not match its config: missing \['lm_head.weight'\], unexpected \[\]"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)
    save_file({**state, "model.extra.weight": torch.zeros(2)}, str(f))
    with pytest.raises(ConfigError, match=r"missing \[\], unexpected \['model.extra.weight'\]"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)


def test_a_kill_while_an_old_step_folder_is_removed_leaves_latest_complete(tmp_path, monkeypatch):
    """Saving step N into a --save folder that already has a step_N (a fresh run reusing it): the old folder is removed
    only after the new one is in place, so a kill during that removal leaves `latest` naming a complete checkpoint.
    The trainer is a stand-in that writes files (save_checkpoint's folder handling is what is under test)."""
    import json
    import shutil

    from miles_core.orchestration.checkpoint import LoopState, find_checkpoint, save_checkpoint

    class Trainer:
        def save(self, path):
            path.mkdir(parents=True)
            (path / "state.pt").write_text("x")

        def export_hf(self, family, dest, extra_files):
            dest.mkdir(parents=True)

    save_checkpoint(tmp_path, LoopState(step=1, version=1, prompts_consumed=8), Trainer(), None, None, {})
    real = shutil.rmtree

    def killed(path, *a, **kw):  # the removal of the earlier step_000001 is cut short: its loop.json first, then the kill
        if "step_000001" in str(path) and ".tmp-" not in str(path) and path.exists():
            (path / "loop.json").unlink(missing_ok=True)
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", killed)
    try:
        save_checkpoint(tmp_path, LoopState(step=1, version=2, prompts_consumed=16), Trainer(), None, None, {})
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(shutil, "rmtree", real)
    ckpt = find_checkpoint(tmp_path)
    assert json.loads((ckpt / "loop.json").read_text())["version"] == 2  # the new step_000001, whole


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    """A tensor whose shape disagrees with config.json (another model's file, an edited config) is a user error
    naming the tensor and both shapes, not load_state_dict's RuntimeError."""
    from safetensors.torch import load_file, save_file

    from miles_core.errors import ConfigError

    regs = _saved_llama(tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    save_file({**load_file(str(f)), "model.norm.weight": torch.ones(7)}, str(f))
    with pytest.raises(ConfigError, match=r"'model.norm.weight' has shape \(7,\); its config.json gives \(32,\)"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("hidden_size"), r"config.json has no 'hidden_size'"),
    (lambda c: c.update(num_hidden_layers="2"), r"config.json: cannot build a llama model from it"),
    # a negative RoPE base made every rotary frequency but the first nan, and so every logit
    (lambda c: c.update(rope_theta=-10000.0), r"config.json: cannot build a llama model from it \(rope_theta must be > 0"),
    # 0 was read as absent ('rope_theta or ...') and the model ran silently with the default base 10000
    (lambda c: c.update(rope_theta=0), r"config.json: cannot build a llama model from it \(rope_theta must be > 0, got 0.0\)"),
])
def test_a_config_json_without_a_needed_key_is_named(tmp_path, edit, message):
    import json

    from miles_core.errors import ConfigError

    regs = _saved_llama(tmp_path / "ckpt")
    cfg_file = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    edit(cfg)
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)
    cfg_file.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: not a JSON object"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)


def test_a_tied_checkpoint_whose_head_differs_from_its_embedding_is_refused(tmp_path):
    """With tie_word_embeddings the head and the embedding are one tensor: a file that holds both with other
    values loaded its head over the embedding (transformers unties them instead). Equal values still load."""
    from safetensors.torch import load_file, save_file

    from miles_core.errors import ConfigError

    regs = _saved_llama(tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(f))
    embed = state["model.embed_tokens.weight"]
    save_file({**state, "lm_head.weight": embed.clone()}, str(f))
    back, _ = load_hf_folder(tmp_path / "ckpt", regs.model_families)
    assert torch.equal(back.model.embed_tokens.weight, embed)
    save_file({**state, "lm_head.weight": torch.randn_like(embed)}, str(f))
    with pytest.raises(ConfigError, match="tie_word_embeddings is true, but its 'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        load_hf_folder(tmp_path / "ckpt", regs.model_families)


def test_a_sharded_folder_loads_the_shards_its_index_names(tmp_path):
    """model.safetensors.index.json says which files hold the model (transformers reads only those): every
    *.safetensors in the folder was read, so an earlier save's shards left beside the new ones (another shard
    count: other names) were loaded over them, sorted after them. A shard the index names that is missing is named."""
    import json

    from safetensors.torch import load_file, save_file

    from miles_core.errors import ConfigError

    ckpt = tmp_path / "ckpt"
    regs = _saved_llama(ckpt, seed=0)
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(ckpt / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({k: torch.zeros_like(state[k]) for k in names[:3]}, str(ckpt / "model-00001-of-00003.safetensors"))  # stale
    back, _ = load_hf_folder(ckpt, regs.model_families)
    for k in names:
        assert torch.equal(back.state_dict()[k], state[k]), k
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="'model-00002-of-00002.safetensors', which model.safetensors.index.json names, is not there"):
        load_hf_folder(ckpt, regs.model_families)


def test_a_model_safetensors_is_the_model_whatever_else_the_folder_holds(tmp_path):
    """transformers reads only ``model.safetensors`` where there is one; every other ``*.safetensors`` beside it (an
    adapter_model.safetensors, a consolidated.safetensors, an earlier sharded save's files) was loaded too, so such a
    folder was refused ("unexpected [...]") or had the other file's tensors loaded over the model's."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    regs = _saved_llama(ckpt, seed=0)
    state = load_file(str(ckpt / "model.safetensors"))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
              str(ckpt / "adapter_model.safetensors"))
    save_file({"model.norm.weight": torch.zeros(32)}, str(ckpt / "model-00002-of-00002.safetensors"))  # stale, sorts first
    save_file({"model.norm.weight": torch.zeros(32)}, str(ckpt / "zz.safetensors"))  # sorts last
    back, _ = load_hf_folder(ckpt, regs.model_families)
    for k, v in state.items():
        assert torch.equal(back.state_dict()[k], v), k


def test_an_export_s_config_names_the_dtype_of_its_tensors(tmp_path):
    """config.json said torch_dtype float32 whatever the tensors were: a bf16 policy (a precision recipe keeping bf16
    weights) was exported as bf16 tensors labelled float32, so transformers loaded it upcast to fp32 (twice the memory)
    and servers that pick their dtype from config.json (vLLM, SGLang: dtype auto) ran it in another dtype than trained."""
    import json

    transformers = pytest.importorskip("transformers")
    regs = MilesPlugins(autoload=False).registries
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        model = model.to(dtype)
        save_hf_folder(model, regs.model_families.get("llama"), tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["torch_dtype"] == name
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True)
        assert hf.dtype == dtype
        assert torch.equal(hf.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_atomic_dir_writes_folders_with_subfolders(tmp_path):
    """A writer may make subfolders (a trainer's sharded state, a tokenizer folder): the flush walks them."""

    def write(d):
        (d / "shards").mkdir()
        (d / "shards" / "0.pt").write_text("s0")
        (d / "meta.json").write_text("{}")

    atomic_dir(tmp_path / "out", write)
    assert (tmp_path / "out" / "shards" / "0.pt").read_text() == "s0"
    assert (tmp_path / "out" / "meta.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it


def test_atomic_file_keeps_the_old_file_when_a_write_fails(tmp_path):
    from miles_core.models.checkpoint import atomic_file

    dest = tmp_path / "summary.json"
    atomic_file(dest, lambda tmp: tmp.write_text("v1"))

    def half(tmp):
        tmp.write_text("v2 half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_file(dest, half)
    assert dest.read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left


def test_an_exported_model_is_readable_as_the_umask_allows(tmp_path):
    """mkdtemp makes its folder 0700 and safetensors writes 0600: a saved HF folder was readable by its owner only, so
    a server running as another user (a serving container, a shared model folder) could not load it."""
    import os
    import stat

    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        atomic_dir(tmp_path / "hf", lambda d: save_file({"w": torch.zeros(2)}, str(d / "model.safetensors")))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode) == 0o644


def test_a_quickstart_qwen3_moe_model_is_built_and_exports_to_transformers(tmp_path):
    """model.family=qwen3_moe without a checkpoint builds a Miles-initialised MoE model from the model.* fields, as
    llama and qwen3 do (it raised AttributeError: the plain DecoderConfig has no expert fields)."""
    transformers = pytest.importorskip("transformers")
    from miles_core.config.loader import load_config
    from miles_core.data.tokenizer import CharTokenizer
    from miles_core.models.moe import SparseMoe
    from miles_core.orchestration.build import build_model

    plugins = MilesPlugins()
    torch.manual_seed(0)
    model, family = build_model(load_config(None, ["model.family=qwen3_moe"]), plugins, CharTokenizer())
    assert family.name == "qwen3_moe" and any(isinstance(m, SparseMoe) for m in model.modules())
    save_hf_folder(model, family, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(model(ids)), hf(ids).logits, rtol=1e-4, atol=1e-5)
