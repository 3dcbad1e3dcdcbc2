"""How a save stages tensors and writes files, without torchrun: the stager's options (pinned
memory and non-blocking copies with CUDA, decided here without a GPU), buffers kept between
saves, the checksumming writer, and the one atomic-write helper."""

from __future__ import annotations

import collections
import gc
import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from agent import _dcp_write
from agent._dcp_write import ChecksummedFile, SaveCancelledError
from agent._staging import make_stager, stage_state, staging_options
from agent.atomic_file import write_atomic
from agent.crc32c import crc32c_bytes, crc32c_file, crc32c_file_parallel


class TestStaging:
    def test_with_cuda_host_buffers_are_pinned_and_copies_do_not_block_until_the_end(self) -> None:
        options = staging_options(cuda=True)
        assert options.use_pinned_memory and options.use_non_blocking_copy
        assert not options.use_shared_memory and not options.use_async_staging

    def test_without_cuda_a_plain_memcpy_into_host_buffers(self) -> None:
        options = staging_options(cuda=False)
        assert not options.use_pinned_memory and not options.use_non_blocking_copy

    def test_the_second_save_copies_into_the_buffers_of_the_first(self) -> None:
        state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
        stager = make_stager(cuda=False)
        try:
            first = stager.stage(state)
            pointers = {k: v.data_ptr() for k, v in first.items()}
            state["w"].add_(1.0)
            second = stager.stage(state)
            assert {k: v.data_ptr() for k, v in second.items()} == pointers
            assert torch.equal(second["w"], state["w"])  # the new values, in the old buffer
            assert all(v.data_ptr() != state[k].data_ptr() for k, v in second.items())
        finally:
            stager.close()

    def test_a_tensor_resized_in_place_is_staged_at_its_new_size(self) -> None:
        """DCP's cache asserted that a storage keeps its size: after ``resize_`` every async save failed."""
        state = {"w": torch.randn(8), "seen": torch.arange(4.0)}
        stager = make_stager(cuda=False)
        try:
            kept = stage_state(stager, state)["w"].data_ptr()
            state["seen"].resize_(100)
            state["seen"].copy_(torch.arange(100.0))
            second = stage_state(stager, state)
            assert torch.equal(second["seen"], torch.arange(100.0))
            assert second["w"].data_ptr() == kept  # the others keep their buffers
        finally:
            stager.close()

    def test_a_buffer_the_last_save_did_not_use_is_let_go(self) -> None:
        """A value that left the state but lives on in the script (an EMA saved now and then) kept
        its staged copy in host memory for the stager's life; now only the last save's are kept."""
        state = {"w": torch.randn(8), "ema": torch.randn(1000)}
        stager = make_stager(cuda=False)
        try:
            first = stage_state(stager, state)
            kept = first["w"].data_ptr()
            ema_copy = weakref.ref(first["ema"].untyped_storage())
            del first
            second = stage_state(stager, {"w": state["w"]})
            gc.collect()
            assert ema_copy() is None
            assert second["w"].data_ptr() == kept
        finally:
            stager.close()

    # -- the plain path: stage_state without DCP's deep copy (``_KeptBuffers.stage_plain``) -----

    def test_views_of_one_storage_stay_views_of_one_buffer(self) -> None:
        """Tensors that share a storage (tied weights, a buffer registered with a view of another)
        are staged as views of one buffer, at the same offsets, as DCP's stager stages them. Pins
        what DCP's stager already did; fails with a plain path broken that way."""
        base = torch.arange(48.0).reshape(6, 8)
        state = {"base": base, "row": base[1], "other_row": base[3], "tail": base[2:4, 1:5], "alias": base.view(8, 6)}
        stager = make_stager(cuda=False)
        try:
            for add in (0.0, 1.0):  # the second save copies into the buffers of the first
                base.add_(add)
                staged = stage_state(stager, state)
                pointer = staged["base"].untyped_storage().data_ptr()
                assert pointer != base.untyped_storage().data_ptr()
                for key, source in state.items():
                    assert torch.equal(staged[key], source), key
                    assert staged[key].untyped_storage().data_ptr() == pointer, key
                    assert staged[key].storage_offset() == source.storage_offset(), key
                    assert staged[key].stride() == source.stride(), key
                staged["base"][1, 0] = -1.0  # one buffer: a write through one view shows in the others
                assert staged["row"][0] == -1.0 and staged["alias"][1, 2] == -1.0
        finally:
            stager.close()

    def test_non_contiguous_tensors_are_staged_with_their_strides(self) -> None:
        """A transposed, a strided, an ``expand()``ed and a channels-last tensor keep their strides,
        storage offsets and values, at the first save and when the kept buffers are reused. Pins
        what DCP's stager already did; fails with a plain path broken that way."""
        column = torch.randn(3, 1)
        state = {
            "t": torch.randn(4, 6).t(),
            "every_other": torch.randn(5, 8)[:, 1::2],
            "expanded": column.expand(3, 4),
            "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        }
        stager = make_stager(cuda=False)
        try:
            for _ in range(2):
                staged = stage_state(stager, state)
                for key, source in state.items():
                    assert not source.is_contiguous(), key
                    assert (staged[key].shape, staged[key].stride()) == (source.shape, source.stride()), key
                    assert staged[key].storage_offset() == source.storage_offset(), key
                    assert torch.equal(staged[key], source), key
                column.mul_(2.0)  # what "expanded" views
                for key in ("t", "every_other", "channels_last"):
                    state[key].mul_(2.0)
        finally:
            stager.close()

    def test_a_value_held_twice_is_staged_once(self) -> None:
        """One tensor under two names, and one dict in two places of an optimizer-like nested state,
        are one staged tensor and one staged dict (DCP's deep copy keeps that identity), the tensor
        in one buffer; plain values are staged as they are. Pins what DCP's stager already did;
        fails with a plain path broken that way."""
        w, moment = torch.randn(4, 3), torch.randn(4, 3)
        group = {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "foreach": None, "params": ["w"]}
        per_param = {"exp_avg": moment, "same": w}
        state = {"w": w, "optim": {"state": {"w": per_param, "tied": per_param}, "param_groups": [group]}}
        stager = make_stager(cuda=False)
        try:
            staged = stage_state(stager, state)
            assert staged["optim"]["state"]["w"]["same"] is staged["w"]
            assert staged["optim"]["state"]["tied"] is staged["optim"]["state"]["w"]
            assert torch.equal(staged["w"], w) and torch.equal(staged["optim"]["state"]["w"]["exp_avg"], moment)
            assert staged["w"].data_ptr() != w.data_ptr()
            assert staged["optim"]["param_groups"] == [group] and staged["optim"]["param_groups"][0] is not group
        finally:
            stager.close()

    def test_the_plain_path_stages_what_dcps_stager_stages(self) -> None:
        """The same structure, values, dtypes, shapes, strides, offsets and storage sharing as DCP's
        own deep copy of the state (``StateDictStager.stage``), for a state of every kind it takes.
        Pins what DCP's stager already did; fails with a plain path broken that way."""
        base = torch.randn(6, 8)
        state = {
            "base": base,
            "t": base.t(),
            "slice": base[2:4, 1:5],
            "scalar": torch.tensor(3, dtype=torch.int64),
            "empty": torch.empty(0, 3, dtype=torch.float16),
            "bf16": torch.randn(5).bfloat16(),
            "optim": {"state": {"base": {"m": torch.randn(6, 8), "step": torch.tensor(2.0)}}, "groups": [(1, "a")]},
        }
        plain, dcp = make_stager(cuda=False), make_stager(cuda=False)
        try:
            ours, theirs = stage_state(plain, state), dcp._state_dict_stager.stage(state)
            ours_flat, theirs_flat = _flat(ours), _flat(theirs)
            assert list(ours_flat) == list(theirs_flat)
            buffers_ours, buffers_theirs = {}, {}
            for key, a in ours_flat.items():
                b = theirs_flat[key]
                assert type(a) is type(b), key
                if isinstance(a, torch.Tensor):
                    assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
                        b.dtype,
                        b.shape,
                        b.stride(),
                        b.storage_offset(),
                    ), key
                    assert torch.equal(a, b), key
                    buffers_ours.setdefault(a.untyped_storage().data_ptr(), []).append(key)
                    buffers_theirs.setdefault(b.untyped_storage().data_ptr(), []).append(key)
                else:
                    assert a == b, key
            assert sorted(buffers_ours.values()) == sorted(buffers_theirs.values())
        finally:
            plain.close()
            dcp.close()

    def test_a_state_the_plain_path_does_not_take_is_staged_by_dcp_and_keeps_its_buffers(self) -> None:
        """A value other than plain tensors, dicts, lists, tuples and plain values (here a tensor
        subclass, and an OrderedDict) goes through DCP's stager, whose buffers are then reused. Pins
        what DCP's stager already did; fails with a plain path broken that way."""

        class Marked(torch.Tensor):
            pass

        for odd in (torch.randn(3).as_subclass(Marked), collections.OrderedDict(a=torch.randn(3))):
            state = {"w": torch.randn(16, 16), "odd": odd}
            stager = make_stager(cuda=False)
            try:
                first = stage_state(stager, state)["w"].data_ptr()
                state["w"].add_(1.0)
                second = stage_state(stager, state)
                assert type(second["odd"]) is type(odd) and second["odd"] is not odd
                assert second["w"].data_ptr() == first
                assert torch.equal(second["w"], state["w"])
            finally:
                stager.close()

    def test_a_class_in_the_state_is_staged_by_the_same_stager_save_after_save(self) -> None:
        """A class whose metaclass is not ``type`` (as ``abc.ABC`` subclasses; a DTensor's state holds
        such) goes through DCP's stager on every save. torch 2.11 and 2.12's ``DefaultStager`` emptied
        its deep-copy table after each stage, and the second save failed with
        ``KeyError: <class 'type'>``; under torch 2.13 this pins what already worked."""

        class Meta(type):
            pass

        class Kind(metaclass=Meta):
            pass

        state = {"w": torch.randn(4), "kind": Kind}
        stager = make_stager(cuda=False)
        try:
            for _ in range(3):
                staged = stage_state(stager, state)
                assert staged["kind"] is Kind
                assert torch.equal(staged["w"], state["w"])
        finally:
            stager.close()

    def test_a_freed_tensors_buffer_goes_with_it_and_close_frees_the_rest(self) -> None:
        """As DCP's cache does: a buffer goes as soon as its source tensor is freed, before any
        later save; ``close()`` (what ``release_staging`` and ``Checkpointer.close`` call) frees
        all. Pins what DCP's stager already did; fails with a plain path broken that way."""
        state = {"w": torch.randn(8), "ema": torch.randn(1000)}
        stager = make_stager(cuda=False)
        try:
            staged = stage_state(stager, state)
            ema_copy = weakref.ref(staged["ema"].untyped_storage())
            w_copy = weakref.ref(staged["w"].untyped_storage())
            del staged
            del state["ema"]
            gc.collect()
            assert ema_copy() is None
            assert w_copy() is not None  # kept for the next save
        finally:
            stager.close()
        gc.collect()
        assert w_copy() is None


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state's leaves by path, its containers' types included."""
    out: dict[str, Any] = {prefix + ":type": type(value)}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}"))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            out.update(_flat(item, f"{prefix}.{i}"))
    else:
        out[prefix] = value
    return out


class TestChecksummedFile:
    def test_the_crc_of_what_it_wrote_is_the_crc_of_the_file(self, tmp_path: Path) -> None:
        path = str(tmp_path / "shard")
        big = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: written as blocks from its own memory
        with ChecksummedFile(path, writeback=True) as f:
            f.write(b"header")
            f.write(memoryview(big.numpy()).cast("B"))
            f.write(b"x" * 1000)
            assert f.tell() == 6 + big.nbytes + 1000
        assert (f.crc, f.size) == crc32c_file(path)
        assert crc32c_file_parallel(path, parallelism=4, piece=1 << 20) == crc32c_file(path)

    def test_a_buffered_write_keeps_only_a_few_blocks_in_the_page_cache(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each block's writeback starts as it is written; once WRITEBACK_LAG blocks are on their
        way, the oldest is waited for and dropped, so the page cache a save holds stays bounded."""
        started: list[tuple[int, int]] = []
        finished: list[tuple[int, int]] = []
        real_finish = _dcp_write.finish_writeback

        def record_start(fd: int, offset: int, length: int) -> None:
            started.append((offset, length))

        def record_finish(fd: int, offset: int, length: int) -> None:
            assert (offset, length) in started and finished == started[: len(finished)], "oldest first"
            finished.append((offset, length))
            real_finish(fd, offset, length)  # the real calls, on a real file

        monkeypatch.setattr(_dcp_write, "start_writeback", record_start)
        monkeypatch.setattr(_dcp_write, "finish_writeback", record_finish)
        block, lag = ChecksummedFile.BLOCK, ChecksummedFile.WRITEBACK_LAG
        data = torch.arange((lag + 3) * block // 4, dtype=torch.float32)  # lag + 3 blocks
        path = str(tmp_path / "shard")
        with ChecksummedFile(path, writeback=True) as f:
            f.write(memoryview(data.numpy()).cast("B"))
        assert started == [(i * block, block) for i in range(lag + 3)]
        assert finished == started[:3]
        assert (f.crc, f.size) == crc32c_file(path) and f.size == data.nbytes
        assert torch.equal(torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.float32), data)
        finished.clear()
        with ChecksummedFile(str(tmp_path / "staged"), writeback=False) as f:  # an upload buffer: left alone
            f.write(memoryview(data.numpy()).cast("B"))
        assert finished == []

    def test_a_cancelled_write_stops_and_leaves_no_file(self, tmp_path: Path) -> None:
        path = tmp_path / "shard"
        cancel = threading.Event()
        with pytest.raises(SaveCancelledError), ChecksummedFile(str(path), cancel=cancel) as f:
            f.write(b"a" * (2 << 20))
            cancel.set()
            f.write(b"b" * (2 << 20))
        assert not path.exists()


class TestWriteAtomic:
    def test_replaces_the_file_whole_with_the_mode_asked_for_and_leaves_no_temp_file(self, tmp_path: Path) -> None:
        path = tmp_path / "token"
        path.write_text("old")
        os.chmod(path, 0o644)
        write_atomic(str(path), b"secret\n", mode=0o600)
        assert path.read_bytes() == b"secret\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert os.listdir(tmp_path) == ["token"]

    def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "status.json"
        path.write_bytes(b"old")

        def failing_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError, match="Input/output error"):
            write_atomic(str(path), b"new")
        assert path.read_bytes() == b"old"
        assert os.listdir(tmp_path) == ["status.json"]

    def test_a_crc_continues_across_pieces(self) -> None:
        data = os.urandom(10_000)
        assert crc32c_bytes(data[5000:], crc32c_bytes(data[:5000])) == crc32c_bytes(data)


FAIL_INSIDE_TORCH_SAVE = """
import os, sys, threading, torch
from agent._dcp_write import ChecksummedFile, SaveCancelledError, save_tensor_without_crc

kind = sys.argv[2]
cancel = threading.Event()

class Failing(ChecksummedFile):
    def _out(self, view):
        if self.size >= self.BLOCK:  # the second block of the tensor's storage
            if kind == "cancel":
                cancel.set()
            else:
                raise OSError(28, "No space left on device")
        super()._out(view)

tensor = torch.zeros(12 * 1024 * 1024)  # 48 MB: several blocks
try:
    with Failing(sys.argv[1], cancel=cancel) as f:
        save_tensor_without_crc(tensor, f)
        f.check()
except SaveCancelledError:
    print("cancelled")
except OSError as e:
    print("failed:", e.strerror)
print("file left:", os.path.exists(sys.argv[1]))
"""


@pytest.mark.parametrize(("kind", "said"), [("cancel", "cancelled"), ("enospc", "failed: No space left on device")])
def test_a_failure_in_the_middle_of_a_tensor_is_raised_after_torchs_writer_not_into_it(
    tmp_path: Path, kind: str, said: str
) -> None:
    """An exception thrown into torch.save's zip writer used to abort the process when the writer
    was finished later ("terminate called ... unexpected pos"); it is kept and raised afterwards."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FAIL_INSIDE_TORCH_SAVE, str(tmp_path / "shard"), kind],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [said, "file left: False"]


def test_the_writers_metadata_names_each_tensors_files_when_torchs_finish_writes_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.9.1's ``FileSystemWriter.finish`` fills the shard files into a copy of the metadata
    (``dataclasses.replace``) and leaves the one passed without them; 2.13 fills them in place. The
    writer's ``metadata``, from which MANIFEST.json's tensor index is built, held no files under
    2.9.1 (``ckpt verify --deep`` then found the index disagreeing with .metadata). Here the 2.9.1
    behaviour is reproduced on the installed torch."""
    import dataclasses

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from agent.dcp_safe import load_dcp_metadata, tensor_index

    real_finish = FileSystemWriter.finish

    def finish_on_a_copy(self: FileSystemWriter, metadata: Any, results: Any) -> None:
        real_finish(self, dataclasses.replace(metadata), results)

    monkeypatch.setattr(FileSystemWriter, "finish", finish_on_a_copy)
    writer = _dcp_write._Writer(str(tmp_path), durable=False)
    save({"w": torch.arange(6.0), "b": torch.ones(2)}, storage_writer=writer, no_dist=True)
    assert writer.metadata is not None
    on_disk = load_dcp_metadata((tmp_path / ".metadata").read_bytes())
    assert tensor_index(writer.metadata) == tensor_index(on_disk)
    assert all(entry.files for entry in tensor_index(writer.metadata).values())


def _index_metadata(placed: dict[tuple[str, int], str]) -> Any:
    """DCP metadata of two tensors, ``w`` in two row chunks and ``b`` in two, each chunk in the
    file ``placed`` names by (tensor, chunk)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def chunks(rows: int) -> list[Any]:
        return [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 2])) for r in range(rows)]

    sdm = {
        "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 2]), chunks(2)),
        "b": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([2, 2]), chunks(2)),
    }
    storage = {
        MetadataIndex(fqn, torch.Size([row, 0])): _StorageInfo(path, 16 * row, 16)
        for (fqn, row), path in placed.items()
    }
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def test_the_tensor_index_lists_each_tensors_files_once_in_order_and_holds_no_set_per_tensor() -> None:
    """The files of each tensor were gathered into a set per tensor first: for 8000 tensors, 8000
    objects the garbage collector tracks, held while the index was built. A tensor in one file
    is now that file's name; the rare one spread over several still lists each file once, sorted."""
    from agent import dcp_safe

    spread = _index_metadata(
        {("w", 0): "__1_0.distcp", ("w", 1): "__0_0.distcp", ("b", 0): "__0_0.distcp", ("b", 1): "__0_0.distcp"}
    )
    index = dcp_safe.tensor_index(spread)
    assert index["w"].files == ["__0_0.distcp", "__1_0.distcp"]
    assert index["b"].files == ["__0_0.distcp"]
    assert (index["w"].shape, index["w"].dtype, index["b"].dtype) == ([2, 2], "float32", "bfloat16")
    whole = _index_metadata({(fqn, row): "__0_0.distcp" for fqn in ("w", "b") for row in (0, 1)})
    files = dcp_safe._tensor_files(whole)
    assert files == {"w": "__0_0.distcp", "b": "__0_0.distcp"} and not gc.is_tracked(files)


def test_the_tensor_index_cache_hands_out_the_last_entries_only_for_the_same_tensors_in_the_same_files() -> None:
    """``TensorIndexCache`` reuses the last index's (frozen) entries, in a dict of its own each time,
    when the metadata is the same ``state_dict_metadata`` object (a save of the cached plans) and
    its tensors lie in the same files; other files, or metadata that is only equal, build anew."""
    import dataclasses

    from agent import dcp_safe

    first = _index_metadata({(fqn, row): "__0_0.distcp" for fqn in ("w", "b") for row in (0, 1)})
    cache = dcp_safe.TensorIndexCache()
    index = cache.index(first)
    again = cache.index(dataclasses.replace(first))  # DCP's metadata of the cached plans: a copy
    assert again == index and again is not index and all(again[k] is index[k] for k in index)
    again["w"] = again["b"]  # a manifest's dict is its own: the cache's is untouched
    assert cache.index(first)["w"] is index["w"]

    moved = dataclasses.replace(first, storage_data={**first.storage_data})
    (b1,) = [i for i in moved.storage_data if i.fqn == "b" and i.offset[0] == 1]
    moved.storage_data[b1] = dataclasses.replace(moved.storage_data[b1], relative_path="__1_0.distcp")
    elsewhere = cache.index(moved)
    assert elsewhere["b"].files == ["__0_0.distcp", "__1_0.distcp"] and elsewhere["w"] is not index["w"]
    assert elsewhere == dcp_safe.tensor_index(moved)

    equal = _index_metadata({(fqn, row): "__0_0.distcp" for fqn in ("w", "b") for row in (0, 1)})
    rebuilt = cache.index(equal)  # planned afresh: another object, even with the same contents
    assert rebuilt == index and rebuilt["w"] is not index["w"]
