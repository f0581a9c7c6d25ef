"""Native Orbax checkpoints: save -> restore equal, layout conversion, shardings, atomicity, load_model."""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpax.checkpoint.orbax import LazyArray, find_model_folder, load_model, restore_params, save_params
from grpax.models.params import abstract_params
from grpax.models.registry import ModelConfig, to_hf_config

CFG = ModelConfig(
    vocab_size=101,
    hidden_dim=16,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=24,
    bos_token_id=96,
    eos_token_ids=(98,),
)


def _params(scan_layers: bool, dtype: str = "float32"):
    cfg = CFG.replace(scan_layers=scan_layers, weight_dtype=dtype)
    rng = np.random.RandomState(0)  # numpy, not init_params: no per-shape compiles in this file
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), abstract_params(cfg))
    return params, cfg


def _assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["stacked", "list"])
def test_save_restore_equal(tmp_path, scan_layers, dtype):
    params, _ = _params(scan_layers, dtype)
    save_params(params, tmp_path / "0" / "items")
    restored = restore_params(tmp_path / "0" / "items")
    _assert_equal(params, restored)
    assert isinstance(jax.tree.leaves(restored)[0], np.ndarray)
    if dtype == "bfloat16":
        assert restored["embed"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("zarr3, ocdbt", [(False, False), (True, False), (False, True)])
def test_storage_options(tmp_path, zarr3, ocdbt):
    params, _ = _params(True)
    save_params(params, tmp_path / "ckpt", use_zarr3=zarr3, use_ocdbt=ocdbt)
    _assert_equal(params, restore_params(tmp_path / "ckpt"))


@pytest.mark.parametrize("saved, wanted", [(True, False), (False, True)])
def test_restore_converts_layout_and_dtype(tmp_path, saved, wanted):
    params, _ = _params(saved)
    save_params(params, tmp_path / "ckpt")
    cfg = CFG.replace(scan_layers=wanted, weight_dtype="bfloat16")
    restored = restore_params(tmp_path / "ckpt", cfg)
    assert isinstance(restored["layers"], dict) == wanted
    stacked = (
        params["layers"]
        if saved
        else {k: np.stack([la[k] for la in params["layers"]]) for k in params["layers"][0]}
    )
    for k, v in stacked.items():
        got = restored["layers"][k] if wanted else np.stack([la[k] for la in restored["layers"]])
        assert got.dtype == ml_dtypes.bfloat16
        assert np.array_equal(got, v.astype(ml_dtypes.bfloat16)), k


def test_restore_to_sharding(tmp_path):
    params, _ = _params(True)
    save_params(params, tmp_path / "ckpt")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = restore_params(tmp_path / "ckpt", CFG, sharding=sharding)
    assert all(isinstance(x, jax.Array) and x.sharding == sharding for x in jax.tree.leaves(restored))
    _assert_equal(params, jax.tree.map(np.asarray, restored))
    # Layout conversion on the way to devices.
    unscanned = restore_params(tmp_path / "ckpt", CFG.replace(scan_layers=False), sharding=sharding)
    assert len(unscanned["layers"]) == 3 and isinstance(unscanned["layers"][0]["wq"], jax.Array)
    assert np.array_equal(np.asarray(unscanned["layers"][2]["wq"]), params["layers"]["wq"][2])


def test_failed_write_leaves_nothing_restorable(tmp_path, monkeypatch):
    params, _ = _params(True)
    original = ocp.type_handlers.NumpyHandler.serialize

    async def fail_after_writing(self, values, infos, args=None):
        await original(self, values, infos, args)
        raise OSError("disk full")

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "serialize", fail_after_writing)
    with pytest.raises(OSError, match="disk full"):
        save_params(params, tmp_path / "0" / "items")
    assert not (tmp_path / "0" / "items").exists()
    for leftover in (tmp_path / "0").iterdir():  # cleanup is best effort; a leftover must never restore
        with pytest.raises(FileNotFoundError, match="interrupted or unfinished"):
            restore_params(leftover)
    with pytest.raises(FileNotFoundError, match="not a grpax/Orbax params checkpoint"):
        restore_params(tmp_path / "0" / "items")


def test_unfinished_orbax_tmp_folder_is_rejected(tmp_path):
    tmp = tmp_path / "items.orbax-checkpoint-tmp-123"
    tmp.mkdir()
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(FileNotFoundError, match="interrupted or unfinished"):
        restore_params(tmp)


def test_save_refuses_existing(tmp_path):
    params, _ = _params(True)
    save_params(params, tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="already exists"):
        save_params(params, tmp_path / "ckpt")


def test_restore_hints_at_items(tmp_path):
    params, _ = _params(True)
    save_params(params, tmp_path / "0" / "items")
    with pytest.raises(FileNotFoundError, match="did you mean .*0/items"):
        restore_params(tmp_path)


def test_restore_hints_at_model_params(tmp_path):
    params, _ = _params(True)
    save_params(params, tmp_path / "actor" / "2" / "model_params")
    with pytest.raises(FileNotFoundError, match=r"did you mean .*actor/2/model_params\?"):
        restore_params(tmp_path / "actor" / "2")


def _model_folder(folder, tokenizer: bool = True):
    from test_convert import save_tiny_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(to_hf_config(CFG)))
    if tokenizer:
        save_tiny_tokenizer(folder)


def test_load_model_converted_and_trained_layouts(tmp_path):
    params, _ = _params(True, "bfloat16")
    # Converted: <base>/config.json + <base>/0/items.
    _model_folder(tmp_path / "base")
    save_params(params, tmp_path / "base" / "0" / "items")
    # Trained: <base>/<run>/checkpoints/{config.json, actor/<step>/model_params}.
    ckpts = tmp_path / "base" / "run1" / "checkpoints"
    _model_folder(ckpts)
    save_params(params, ckpts / "actor" / "20" / "model_params")
    for path in (tmp_path / "base" / "0" / "items", ckpts / "actor" / "20" / "model_params"):
        loaded, cfg, tok = load_model(path, scan_layers=False)
        assert cfg.weight_dtype == "bfloat16" and not cfg.scan_layers
        assert (cfg.vocab_size, cfg.num_layers, cfg.eos_token_ids) == (101, 3, (98,))
        assert len(loaded["layers"]) == 3
        assert np.array_equal(loaded["layers"][1]["w_up"], params["layers"]["w_up"][1])
        assert tok.convert_tokens_to_ids("<|im_end|>") == 98 and tok.chat_template
    assert find_model_folder(ckpts / "actor" / "20" / "model_params") == ckpts
    loaded, cfg, _ = load_model(tmp_path / "base" / "0" / "items", weight_dtype="float32")
    assert loaded["embed"].dtype == np.float32 and cfg.scan_layers


def test_load_model_errors_name_paths(tmp_path):
    params, _ = _params(True)
    save_params(params, tmp_path / "a" / "0" / "items")
    with pytest.raises(FileNotFoundError, match="no config.json at or above .*a/0/items"):
        load_model(tmp_path / "a" / "0" / "items")
    _model_folder(tmp_path / "a", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*a "):
        load_model(tmp_path / "a" / "0" / "items")
    with pytest.raises(FileNotFoundError, match="checkpoint .*missing does not exist"):
        load_model(tmp_path / "missing")


def _lazy(params, built: list[str]):
    """``params`` with every leaf replaced by a ``LazyArray`` that logs its build and returns a copy."""

    def lazy(path, x):
        def build():
            built.append(jax.tree_util.keystr(path))
            return x.copy()

        return LazyArray(x.shape, x.dtype, build)

    return jax.tree_util.tree_map_with_path(lazy, params)


@pytest.mark.parametrize("zarr3, ocdbt", [(True, True), (False, False), (True, False), (False, True)])
def test_lazy_leaves_restore_like_a_plain_save(tmp_path, zarr3, ocdbt):
    params, _ = _params(True, "bfloat16")
    built: list[str] = []
    save_params(_lazy(params, built), tmp_path / "lazy", use_zarr3=zarr3, use_ocdbt=ocdbt)
    assert sorted(built) == sorted(
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
    )
    _assert_equal(params, restore_params(tmp_path / "lazy"))
    _assert_equal(params, ocp.PyTreeCheckpointer().restore(tmp_path / "lazy"))  # plain Orbax, no grpax code
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_device = restore_params(tmp_path / "lazy", CFG.replace(weight_dtype="bfloat16"), sharding=sharding)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(on_device))
    _assert_equal(params, jax.tree.map(np.asarray, on_device))
    # The tree metadata is exactly what a plain save of the numpy tree writes.
    save_params(params, tmp_path / "plain", use_zarr3=zarr3, use_ocdbt=ocdbt)
    meta = [json.loads((tmp_path / d / "_METADATA").read_text()) for d in ("lazy", "plain")]
    assert meta[0]["tree_metadata"] == meta[1]["tree_metadata"]
    assert meta[0]["use_zarr3"] == meta[1]["use_zarr3"] == zarr3


@pytest.mark.parametrize("budget_leaves", [0, 3])
def test_lazy_leaves_are_built_one_at_a_time_and_freed_within_the_budget(
    tmp_path, monkeypatch, budget_leaves
):
    """Built leaves alive at once stay within STREAM_BYTES (0: one at a time, each dropped before the next is
    built; 3 of the largest leaves: several written side by side), and each leaf is built once."""
    import weakref

    import grpax.checkpoint.orbax as orbax_lib

    params, _ = _params(True)
    largest = max(x.nbytes for x in jax.tree.leaves(params))
    monkeypatch.setattr(orbax_lib, "STREAM_BYTES", budget_leaves * largest)
    live, peak, order = [0, 0], [0, 0], []  # leaves, bytes

    def release(nbytes):
        live[0] -= 1
        live[1] -= nbytes

    def lazy(path, x):
        def build():
            live[0] += 1
            live[1] += x.nbytes
            peak[:] = [max(p, n) for p, n in zip(peak, live, strict=True)]
            order.append(jax.tree_util.keystr(path))
            out = x.copy()
            weakref.finalize(out, release, x.nbytes)
            return out

        return LazyArray(x.shape, x.dtype, build)

    save_params(jax.tree_util.tree_map_with_path(lazy, params), tmp_path / "ckpt")
    if budget_leaves:
        assert peak[0] > 1 and peak[1] <= budget_leaves * largest  # side by side, within the budget
    else:
        assert peak[0] == 1  # each built leaf was dropped before the next was built
    assert live == [0, 0]
    assert len(order) == len(set(order)) == len(jax.tree.leaves(params))
    _assert_equal(params, restore_params(tmp_path / "ckpt"))


def test_failed_lazy_build_leaves_nothing(tmp_path):
    params, _ = _params(True)

    def wrong_shape():
        return np.zeros((2, 2), np.float32)

    params["layers"]["wq"] = LazyArray(params["layers"]["wq"].shape, np.dtype(np.float32), wrong_shape)
    with pytest.raises(ValueError, match=r"wq.*built float32\[2, 2\], declared float32\[3, 16, 4, 8\]"):
        save_params(params, tmp_path / "0" / "items")
    assert not (tmp_path / "0" / "items").exists()
    assert list((tmp_path / "0").iterdir()) == []


def test_lazy_save_copies_no_leaf(tmp_path, monkeypatch):
    # The streaming handler exists to hold one leaf at a time: the stock handler's deep copy of every array
    # (Orbax's NumpyHandler.serialize) must never run, whichever Orbax is installed.
    from orbax.checkpoint._src.serialization import type_handlers

    copied = []

    class CopySpy:
        @staticmethod
        def deepcopy(x, *args):
            copied.append(type(x))
            return copy.deepcopy(x, *args)

    monkeypatch.setattr(type_handlers, "copy", CopySpy)
    params, _ = _params(True)
    save_params(_lazy(params, []), tmp_path / "ckpt")
    assert np.ndarray not in copied
    _assert_equal(params, restore_params(tmp_path / "ckpt"))


def test_lazy_save_works_with_orbax_0_12_4s_numpy_handler(tmp_path, monkeypatch):
    # orbax-checkpoint 0.12.4 (pyproject's floor) has no deepcopy_host_arrays argument; a handler that passed
    # it failed with "NumpyHandler.__init__() got an unexpected keyword argument" (grpax to_native).
    from orbax.checkpoint._src.serialization import type_handlers

    def init_of_0_12_4(self, metadata_key=None, ocdbt_process_id=None):
        self._metadata_key = metadata_key
        self._override_ocdbt_process_id = ocdbt_process_id
        self._deepcopy_host_arrays = True  # what the newer stock serialize reads; never used by grpax's

    monkeypatch.setattr(type_handlers.NumpyHandler, "__init__", init_of_0_12_4)
    params, _ = _params(True)
    save_params(_lazy(params, []), tmp_path / "ckpt")
    _assert_equal(params, restore_params(tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A finished params checkpoint to copy and damage."""
    folder = tmp_path_factory.mktemp("saved") / "0" / "items"
    save_params(_params(True)[0], folder)
    return folder


def _damaged(saved, tmp_path, damage):
    import shutil

    folder = tmp_path / "0" / "items"
    shutil.copytree(saved, folder)
    damage(folder)
    return folder


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "manifest.ocdbt").unlink(), "manifest.ocdbt is missing"),
        (lambda f: _truncate(f / "_METADATA"), "_METADATA is truncated or not valid JSON"),
        (
            lambda f: _truncate(max(f.rglob("d/*"), key=lambda p: p.stat().st_size)),
            # which arrays share the largest data file depends on OCDBT's packing: any stored array's name
            r"reading (embed|final_norm|lm_head|layers\.\w+) failed with OUT_OF_RANGE \(a truncated or corrupt data file\)",
        ),
    ],
    ids=["no-manifest", "truncated-metadata", "truncated-data"],
)
def test_damaged_checkpoint_is_named_with_the_fix(saved_checkpoint, tmp_path, damage, message):
    folder = _damaged(saved_checkpoint, tmp_path, damage)
    with pytest.raises(ValueError, match=rf"{folder} is damaged: {message}; re-convert the model") as err:
        restore_params(folder)
    assert "\n" not in str(err.value)


def test_optimizer_state_folder_points_to_model_params(tmp_path):
    from grpax.checkpoint.train_state import TrainCheckpointer

    params, _ = _params(True)
    checkpointer = TrainCheckpointer(tmp_path / "checkpoints", 3, True, True)
    checkpointer.save(2, params, [{"mu": params}, ()], {"step": 2})  # optax states are tuples/lists
    checkpointer.close()
    step = tmp_path / "checkpoints" / "actor" / "2"
    with pytest.raises(
        ValueError,
        match=rf"{step}/opt_state is an Orbax checkpoint but not of model params.*: "
        rf"pass {step}/model_params$",
    ):
        restore_params(step / "opt_state")


def test_train_checkpoints_are_written_uncompressed_and_compressed_ones_still_restore(tmp_path):
    """zstd holds every encoded chunk in host memory until the save ends; the trainer's checkpoints skip it."""
    from grpax.checkpoint.train_state import TrainCheckpointer

    params = {"w": jnp.zeros((512, 1024), jnp.float32), "b": jnp.arange(1024, dtype=jnp.float32)}
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, params)}
    raw = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))

    def saved_bytes(name, **kwargs):
        checkpointer = TrainCheckpointer(tmp_path / name, **kwargs)
        checkpointer.save(1, params, opt_state, {"step": 1})
        restored = checkpointer.restore(1, params, opt_state)
        checkpointer.close()
        np.testing.assert_array_equal(restored[0]["b"], params["b"])
        return sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())

    assert saved_bytes("default") >= raw  # zeros stored as they are: no compression
    assert saved_bytes("zstd", use_compression=True) < raw / 10  # the same zeros, zstd-compressed
    reader = TrainCheckpointer(tmp_path / "zstd")  # the default reads a compressed checkpoint
    restored_params, restored_opt, meta = reader.restore(1, params, opt_state)
    reader.close()
    np.testing.assert_array_equal(restored_params["b"], params["b"])
    assert meta == {"step": 1} and float(jnp.abs(restored_opt["mu"]["w"]).sum()) == 0.0
