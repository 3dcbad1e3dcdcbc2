"""``spotjob-agent --launcher direct`` without a job: which torchrun commands it takes and how,
the environment each rank gets, and how the launcher (``agent.ranks``) ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import ranks
from agent.exit_codes import command_exit_code
from agent.launcher import parse_args
from agent.process_tree import read_proc
from agent.ranks import Ranks, free_port, main, rank_env
from agent.torchrun import DirectLaunch, direct_launch, node_ranks

BOUND_S = 60.0  # only stops a hung test; nothing here asserts how long anything took


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH folder holding a ``torchrun`` whose first line names this interpreter, as pip writes it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "torchrun"
    script.write_text(f"#!{sys.executable}\nimport sys\n")
    script.chmod(0o755)
    return folder


def launch(command: list[str], bin_dir: Path, **env: str) -> DirectLaunch | str:
    return direct_launch(command, {"PATH": str(bin_dir), **env})


def spec(**kw: object) -> DirectLaunch:
    values: dict[str, object] = {
        "nproc": 2,
        "nnodes": 1,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "run_id": "none",
        "role": "default",
        "command": [sys.executable, "-u", "train.py"],
    }
    values.update(kw)
    return DirectLaunch(**values)  # type: ignore[arg-type]


class TestWhatIsLaunchedDirectly:
    def test_the_local_backends_static_rendezvous_for_the_second_node(self, bin_dir: Path) -> None:
        got = launch(
            ["torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
             "10.0.0.5", "--master-port", "29511", "--max-restarts", "0", "train.py", "--steps", "3"],
            bin_dir,
        )  # fmt: skip
        assert got == spec(
            nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29511,
            command=[sys.executable, "-u", "train.py", "--steps", "3"],
        )  # fmt: skip

    def test_standalone_picks_its_port_when_the_ranks_start_and_names_the_run(self, bin_dir: Path) -> None:
        got = launch(["torchrun", "--standalone", "--nproc_per_node=4", "train.py"], bin_dir)
        assert isinstance(got, DirectLaunch)
        assert (got.nproc, got.nnodes, got.master_port) == (4, 1, 0)
        assert got.run_id != "none"

    def test_defaults_options_from_the_environment_and_spellings_as_torchrun_does(self, bin_dir: Path) -> None:
        got = launch(["torchrun", "--master_port=29600", "--", "train.py", "-x"], bin_dir, PET_NPROC_PER_NODE="3")
        assert got == spec(nproc=3, master_port=29600, command=[sys.executable, "-u", "train.py", "-x"])

    def test_modules_no_python_and_python_dash_m_torch_distributed_run(self, bin_dir: Path) -> None:
        module = launch(["torchrun", "-m", "pkg.train", "--lr", "1"], bin_dir)
        assert isinstance(module, DirectLaunch) and module.command == [
            sys.executable,
            "-u",
            "-m",
            "pkg.train",
            "--lr",
            "1",
        ]
        bare = launch(["torchrun", "--no-python", "./train.sh", "a"], bin_dir)
        assert isinstance(bare, DirectLaunch) and bare.command == ["./train.sh", "a"]
        python = os.path.basename(sys.executable)
        os.symlink(sys.executable, bin_dir / python)
        dash_m = launch([python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], bin_dir)
        assert isinstance(dash_m, DirectLaunch) and dash_m.command == [str(bin_dir / python), "-u", "t.py"]

    def test_python_exec_names_the_ranks_interpreter_as_it_does_for_torchrun(self, bin_dir: Path) -> None:
        got = launch(["torchrun", "train.py"], bin_dir, PYTHON_EXEC="/opt/py/bin/python3")
        assert isinstance(got, DirectLaunch) and got.command == ["/opt/py/bin/python3", "-u", "train.py"]

    def test_the_interpreter_of_an_env_shebang_is_looked_up_on_path(self, bin_dir: Path) -> None:
        python = bin_dir / "python3"
        os.symlink(sys.executable, python)
        (bin_dir / "torchrun").write_text("#!/usr/bin/env python3\n")
        got = launch(["torchrun", "train.py"], bin_dir)
        assert isinstance(got, DirectLaunch) and got.command == [str(python), "-u", "train.py"]

    @pytest.mark.parametrize(
        ("command", "why"),
        [
            (["python", "train.py"], "not torchrun"),
            (["torchrun", "--tee", "3", "train.py"], "--tee is torchrun's own"),
            (["torchrun", "--log-dir", "/l", "--redirects", "3", "t.py"], "--log-dir, --redirects are torchrun's own"),
            # torchrun's short spellings (-r, -t) are its options too, with the value apart or attached.
            (["torchrun", "-r", "3", "--nproc-per-node", "2", "train.py"], "--redirects is torchrun's own"),
            (["torchrun", "-t=3", "train.py"], "--tee is torchrun's own"),
            (["torchrun", "-r3", "train.py"], "--redirects is torchrun's own"),
            (["torchrun", "--nnodes", "1:4", "train.py"], "elastic range"),
            (["torchrun", "--max-restarts", "2", "train.py"], "restarts its ranks itself"),
            (["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "t.py"], "rendezvous is torchrun's"),
            (["torchrun", "--nproc-per-node", "gpu", "train.py"], "not a number of ranks"),
            (["torchrun", "--nnodes", "2", "--node-rank", "2", "train.py"], "not one of the 2 nodes"),
            (["torchrun", "--standalone", "--nnodes", "2", "train.py"], "more than one node"),
            (["torchrun", "--nproc-per-node", "2"], "no script"),
            (["python", "-m", "torch.distributed.launch", "train.py"], "deprecated"),
        ],
    )
    def test_anything_else_is_left_to_torchrun_with_the_reason(
        self, command: list[str], why: str, bin_dir: Path
    ) -> None:
        got = launch(command, bin_dir)
        assert isinstance(got, str) and why in got

    def test_a_torchrun_whose_python_cannot_be_told_is_run_as_it_is(self, bin_dir: Path) -> None:
        (bin_dir / "torchrun").write_text('#!/bin/sh\n\'\'\'exec\' "/very/long/python" "$0" "$@"\n')
        got = launch(["torchrun", "train.py"], bin_dir)
        assert isinstance(got, str) and "cannot tell which Python" in got
        assert launch(["torchrun", "train.py"], bin_dir / "nowhere") == "torchrun is not on PATH"

    def test_the_spec_travels_as_json(self) -> None:
        one = spec(run_id="r-1", command=["/p/python", "-u", "t.py", "--x", "${local_rank}"])
        assert DirectLaunch.from_json(one.to_json()) == one


class TestRankEnvironment:
    def test_what_torchruns_static_rendezvous_gives_each_rank(self) -> None:
        base = {"PATH": "/bin", "TORCHELASTIC_ERROR_FILE": "/t/e.json", "KEEP": "me"}
        env = rank_env(spec(nnodes=2, node_rank=1, role="trainer", run_id="job-7"), 1, base, 29555)
        assert {k: v for k, v in env.items() if k not in base or k == "KEEP"} == {
            "KEEP": "me",
            "LOCAL_RANK": "1",
            "RANK": "3",
            "GROUP_RANK": "1",
            "ROLE_RANK": "3",
            "ROLE_NAME": "trainer",
            "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "4",
            "GROUP_WORLD_SIZE": "2",
            "ROLE_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29555",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "job-7",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
        }
        assert "TORCHELASTIC_ERROR_FILE" not in env

    def test_the_users_thread_count_and_nccl_setting_are_kept(self) -> None:
        env = rank_env(spec(), 0, {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, 1)
        assert (env["OMP_NUM_THREADS"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("8", "3")
        assert "OMP_NUM_THREADS" not in rank_env(spec(nproc=1), 0, {}, 1)  # one rank: torchrun sets nothing


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


class TestRanks:
    def test_every_rank_runs_with_its_local_rank_substituted_and_all_zero_is_zero(self, tmp_path: Path) -> None:
        out = tmp_path / "out"
        code = "import os,sys; open(sys.argv[1] + os.environ['RANK'], 'w').write(sys.argv[2])"
        ranks = Ranks(spec(nproc=3, command=[*python(code), str(out), "lr=${local_rank}"]), env={})
        assert ranks.wait() == 0
        assert [(out.parent / f"out{r}").read_text() for r in range(3)] == ["lr=0", "lr=1", "lr=2"]

    def test_the_first_failure_stops_the_others_and_is_the_exit_code(self) -> None:
        code = "import os,sys,time; sys.exit(5) if os.environ['RANK'] == '1' else time.sleep(600)"
        ranks = Ranks(spec(command=python(code)), env={})
        assert ranks.wait() == 5
        assert [p.returncode for p in ranks.procs] == [-signal.SIGTERM, 5]

    def test_the_launcher_waits_for_its_own_ranks_and_leaves_another_childs_exit_status(self) -> None:
        """Ranks run inside a process with a child of its own (a test, a user's launcher): a
        waitpid(-1) would reap that child, whose owner then reads exit 0 instead of its 3."""
        other = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        try:
            give_up = time.monotonic() + BOUND_S
            while (info := read_proc(other.pid)) is not None and info.state != "Z":  # exited, not reaped
                assert time.monotonic() < give_up
                time.sleep(0.01)
            assert Ranks(spec(nproc=2, command=python("pass")), env={}).wait() == 0
            assert other.wait(timeout=BOUND_S) == 3
        finally:
            other.kill()
            other.wait()

    def test_a_rank_killed_by_a_signal_reports_it_as_a_shell_does(self) -> None:
        code = "import os,signal,time; os.kill(os.getpid(), 9) if os.environ['RANK'] == '0' else time.sleep(600)"
        assert Ranks(spec(command=python(code)), env={}).wait() == 128 + signal.SIGKILL
        assert command_exit_code(-6) == 134 and command_exit_code(3) == 3

    def test_a_signal_is_passed_on_to_every_rank_and_ends_the_launcher_once_they_exit(self) -> None:
        ranks = Ranks(spec(command=python("import time; time.sleep(600)")), env={})
        timer = threading.Timer(0.5, ranks.on_signal, args=(signal.SIGTERM,))
        timer.start()
        try:
            assert ranks.wait() == 128 + signal.SIGTERM
        finally:
            timer.cancel()
        assert [p.returncode for p in ranks.procs] == [-signal.SIGTERM, -signal.SIGTERM]

    def test_a_signal_that_comes_while_the_ranks_start_still_reaches_them(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        started = Ranks.__init__

        def start_then_signalled(self: Ranks, *args: object, **kw: object) -> None:
            started(self, *args, **kw)  # type: ignore[arg-type]
            os.kill(os.getpid(), signal.SIGTERM)  # handled here, before main() holds the ranks

        monkeypatch.setattr(Ranks, "__init__", start_then_signalled)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            # Without the signal passed on, the ranks sleep their 30 s and the launcher exits 0.
            assert main([spec(command=python("import time; time.sleep(30)")).to_json()]) == 128 + signal.SIGTERM
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def test_the_module_entry_point_refuses_a_bad_spec_and_reports_a_missing_program(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert main([]) == 2
        assert main(["{not json"]) == 2
        assert "cannot read the launch spec" in capsys.readouterr().err
        assert main([spec(command=["/no/such/python", "t.py"]).to_json()]) == 127
        assert "cannot start /no/such/python" in capsys.readouterr().err


class TestOption:
    def test_torchrun_by_default_direct_on_request_or_from_the_environment(self) -> None:
        argv = ["--checkpoint-uri", "file:///c", "--", "torchrun", "t.py"]
        assert parse_args(argv, {})[0].launcher == "torchrun"
        assert parse_args(["--launcher", "direct", *argv], {})[0].launcher == "direct"
        assert parse_args(argv, {"SPOTJOB_AGENT_LAUNCHER": "direct"})[0].launcher == "direct"
        assert (
            parse_args(["--launcher", "torchrun", *argv], {"SPOTJOB_AGENT_LAUNCHER": "direct"})[0].launcher
            == "torchrun"
        )

    @pytest.mark.parametrize(
        ("args", "env", "named"),
        [
            (["--launcher", "fast"], {}, "--launcher 'fast'"),
            ([], {"SPOTJOB_AGENT_LAUNCHER": "fast"}, "SPOTJOB_AGENT_LAUNCHER 'fast'"),
        ],
    )
    def test_an_unknown_launcher_is_a_usage_error_naming_where_it_came_from(
        self, args: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args([*args, "--checkpoint-uri", "file:///c", "--", "torchrun", "t.py"], env)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert named in err and "torchrun, direct" in err


def test_a_rendezvous_port_is_drawn_under_the_kernels_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bind(0) port is let go before the ranks bind it, and the kernel may hand it to any other
    # process meanwhile (seen in CI: the ranks could not meet). Ports under the range are not.
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t50000\n")
    monkeypatch.setattr(ranks, "_EPHEMERAL_RANGE", str(range_file))
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 40000 - ranks._BELOW_EPHEMERAL <= port < 40000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


def test_a_taken_port_is_never_chosen_and_without_a_free_one_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{taken + 1} 60999")
        monkeypatch.setattr(ranks, "_EPHEMERAL_RANGE", str(range_file))
        monkeypatch.setattr(ranks, "_BELOW_EPHEMERAL", 1)  # the only port to draw is the taken one
        port = free_port("127.0.0.1")
        assert port != taken and 0 < port < 65536

    range_file.write_text("not a range")  # unreadable: drawn under the range Linux has by default
    monkeypatch.setattr(ranks, "_BELOW_EPHEMERAL", 16384)
    assert 32768 - 16384 <= free_port("127.0.0.1") < 32768


@pytest.mark.parametrize(
    ("options", "env", "expected"),
    [
        (["--nproc-per-node", "4"], {}, (range(4), 4)),
        (["--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "2"], {}, (range(4, 6), 6)),
        (["--nproc-per-node=2", "--nnodes=2:2", "--node_rank=1"], {}, (range(2, 4), 4)),
        (["--nnodes", "2"], {"PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1"}, (range(8, 16), 16)),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d"], {}, None),
        (["--nproc-per-node", "2", "--nnodes", "1:4"], {}, None),
        (["--nproc-per-node", "gpu"], {}, None),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2"], {}, None),
    ],
)
def test_the_ranks_of_this_node_are_known_where_the_command_numbers_its_nodes(
    options: list[str], env: dict[str, str], expected: tuple[range, int] | None
) -> None:
    """What the agent's prefetch is told (``--prefetch node``): new with it, pinned here. A c10d or
    elastic rendezvous numbers the nodes as they arrive, so nobody knows before the ranks meet."""
    assert node_ranks(["torchrun", *options, "train.py"], env) == expected
    assert node_ranks(["python", "train.py"], env) is None
