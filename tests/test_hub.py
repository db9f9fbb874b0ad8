"""Hub ids (``ORG/NAME``) downloaded through huggingface_hub from a real HTTP server on 127.0.0.1.

``FakeHub`` answers the routes huggingface_hub calls, with the headers and error codes the hub sends: the
model info API (``/api/models/ORG/NAME/revision/REV``, siblings with sizes), the tree API, and
``/ORG/NAME/resolve/REV/FILE`` (HEAD and GET, with X-Repo-Commit, ETag and Content-Length). A missing repo is
401 RepoNotFound, a bad revision 404 RevisionNotFound, a gated repo's files 401/403 GatedRepo. huggingface_hub
is not mocked: one export runs the CLI in a subprocess with HF_ENDPOINT and HF_HOME; the other cases call it
in-process with ``huggingface_hub.constants`` pointed at the server (it reads the environment at import).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from tiny import tiny_model
from tiny_engine import tiny_tokenizer

from popcompile.errors import ConfigError, ModelDownloadError, ModelNotFoundError, UnsupportedModelError
from popcompile.frontend import hub as hub_module
from popcompile.frontend.models import load_model, resolve_source

# one worker runs this file: the server, the tiny repo and the exported engine are made once per module
pytestmark = pytest.mark.xdist_group("test_hub")

ROOT = Path(__file__).resolve().parents[1]
#: in a repo beside the model, never downloaded: nothing loading reads
JUNK = {"README.md": b"# tiny\n", ".gitattributes": b"*.safetensors filter=lfs\n",
        "pytorch_model.bin": b"not loaded: the safetensors are", "onnx/model.onnx": b"someone else's export",
        "consolidated.safetensors": b"mistral format"}


def commit_of(*parts: str) -> str:
    return hashlib.sha1("/".join(parts).encode()).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    revisions: dict[str, str]  # branch or tag -> commit (every commit holds the same files)
    gated: bool = False
    listed: dict[str, int] = field(default_factory=dict)  # sizes the APIs claim instead of the real ones

    def size(self, path: str) -> int:
        return self.listed.get(path, len(self.files[path]))


class FakeHub:
    """A ThreadingHTTPServer answering as the hub does for ``repos``; ``requests`` logs (method, path)."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos, self.requests = repos, []
        self.authorizations: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"hub": self}))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fetched(self, repo: str, method: str = "GET") -> set[str]:
        """The files of ``repo`` requested from /resolve/ with ``method``."""
        prefix = f"/{repo}/resolve/"
        return {path[len(prefix):].split("/", 1)[1] for m, path in self.requests
                if m == method and path.startswith(prefix)}


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.requests.append((self.command, unquote(path)))
        if "Authorization" in self.headers:
            self.hub.authorizations.append(self.headers["Authorization"])
        routes = ((r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", self._info),
                  (r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", self._tree),
                  (r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self._file))
        for pattern, answer in routes:
            match = re.fullmatch(pattern, path)
            if match:
                repo = self.hub.repos.get(match[1])
                if repo is None:  # the hub answers 401 to an anonymous request for a missing repo
                    return self._error(401, "RepoNotFound", "Repository not found", body)
                revision = unquote(match[2] or "main")
                commit = repo.revisions.get(revision) or (revision if revision in repo.revisions.values()
                                                          else None)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
                return answer(match[1], repo, commit, *(unquote(g) for g in match.groups()[2:]), body=body)
        self._error(404, None, "Not found", body)

    def _info(self, name: str, repo: Repo, commit: str, body: bool) -> None:
        self._send(200, json.dumps({"id": name, "modelId": name, "sha": commit, "private": False,
                                    "gated": "manual" if repo.gated else False,
                                    "siblings": [{"rfilename": path, "size": repo.size(path)}
                                                 for path in repo.files]}).encode(),
                   {"Content-Type": "application/json"}, body)

    def _tree(self, name: str, repo: Repo, commit: str, body: bool) -> None:
        entries = [{"type": "file", "path": path, "size": repo.size(path),
                    "oid": hashlib.sha1(data).hexdigest()} for path, data in repo.files.items()]
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)

    def _file(self, name: str, repo: Repo, commit: str, path: str, body: bool) -> None:
        if repo.gated:  # 401 without a token, 403 with one that has not accepted the licence
            status = 403 if "Authorization" in self.headers else 401
            return self._error(status, "GatedRepo", f"Access to model {name} is restricted. You must have "
                               "access to it and be authenticated to access it. Please log in.", body)
        if path not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found", body, {"X-Repo-Commit": commit})
        data = repo.files[path]
        self._send(200, data, {"Content-Type": "application/octet-stream", "X-Repo-Commit": commit,
                               "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)

    def _error(self, status: int, code: str | None, message: str, body: bool, headers: dict | None = None):
        extra = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
        self._send(status, json.dumps({"error": message}).encode(), {"Content-Type": "application/json",
                                                                      **extra}, body)

    def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny llama as save_pretrained writes it, in 200 KB safetensors shards with an index."""
    folder = tmp_path_factory.mktemp("tiny-repo")
    model = tiny_model("llama", layers=4, max_position_embeddings=256)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, max_shard_size="200KB")
    tokenizer.save_pretrained(folder)
    return {path.relative_to(folder).as_posix(): path.read_bytes()
            for path in folder.rglob("*") if path.is_file()}


MAIN, V1 = commit_of("tiny", "main"), commit_of("tiny", "v1")


@pytest.fixture(scope="module")
def server(tiny_files):
    shards = [path for path in tiny_files if re.fullmatch(r"model-.*\.safetensors", path)]
    assert len(shards) > 1 and "model.safetensors.index.json" in tiny_files
    config = json.loads(tiny_files["config.json"])
    small = {path: data for path, data in tiny_files.items() if not path.endswith(".safetensors")
             and path != "model.safetensors.index.json"}
    repos = {
        "org/tiny": Repo({**tiny_files, **JUNK}, {"main": MAIN, "v1": V1}),
        "org/gated": Repo(tiny_files, {"main": commit_of("gated")}, gated=True),
        "org/bin": Repo({**small, "pytorch_model.bin": b"weights", "flax_model.msgpack": b"flax"},
                        {"main": commit_of("bin")}),
        "org/bert": Repo({**small, "config.json": json.dumps({**config, "model_type": "bert"}).encode(),
                          "model.safetensors": b"bert weights"}, {"main": commit_of("bert")}),
        "org/huge": Repo(tiny_files, {"main": commit_of("huge")}, listed={s: 2 ** 50 for s in shards}),
        "org/liar": Repo(tiny_files, {"main": commit_of("liar")}, listed={s: 1 for s in shards}),
    }
    hub = FakeHub(repos)
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def point_at(monkeypatch, url: str, home: Path, *, offline: bool = False) -> Path:
    """huggingface_hub's settings as HF_ENDPOINT=url, HF_HOME=home (and HF_HUB_OFFLINE) would make them at
    import, without a token; returns the cache folder."""
    from huggingface_hub import constants

    settings = {"ENDPOINT": url,
                "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
                "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": offline,
                "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens")}
    for name, value in settings.items():
        monkeypatch.setattr(constants, name, value, raising=False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return home / "hub"


@pytest.fixture
def hub(server, tmp_path, monkeypatch) -> Path:
    """Online, at the test server, with an empty cache; returns the cache folder."""
    return point_at(monkeypatch, server.url, tmp_path / "hf")


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def skip_retry_waits(monkeypatch) -> None:
    """huggingface_hub tries a file that is not cached 6 times over 23 s before it gives up (http_backoff):
    the tries stay, the waits between them go."""
    import time
    import types

    from huggingface_hub.utils import _http

    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if name[0] != "_"})
    clock.sleep = lambda seconds: None
    monkeypatch.setattr(_http, "time", clock)


def snapshot_files(cache: Path, repo: str, commit: str) -> set[str]:
    folder = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}


def hub_env(url: str, home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                          "HF_HUB_CACHE")}
    return {**env, "HF_ENDPOINT": url, "HF_HOME": str(home)}


@pytest.fixture(scope="module")
def exported(server, tmp_path_factory):
    """`popcompile export org/tiny --revision v1` in a subprocess, HF_ENDPOINT at the server, HF_HOME new:
    (the cache, the engine folder, the finished process)."""
    root = tmp_path_factory.mktemp("exported")
    out = root / "engine"
    done = subprocess.run(
        [sys.executable, "-m", "popcompile.cli", "export", "org/tiny", "--revision", "v1", "--out", str(out),
         "--cut", "3", "--max-seq", "64", "--kv-calibration", "none", "--min-prompt-tokens", "0"],
        cwd=ROOT, env=hub_env(server.url, root / "hf"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "hf" / "hub", out, done


def test_export_downloads_only_what_loading_reads(exported, server, tiny_files):
    from popcompile.engine.manifest import EngineManifest

    cache, out, done = exported
    assert f"downloading org/tiny (v1, commit {V1[:12]}) into {cache}" in done.stderr
    assert server.fetched("org/tiny") == set(tiny_files)  # what save_pretrained wrote, none of JUNK
    assert snapshot_files(cache, "org/tiny", V1) == set(tiny_files)
    assert (cache / "models--org--tiny" / "refs" / "v1").read_text() == V1  # shared with transformers
    model = EngineManifest.read(out).model
    assert (model["name"], model["kind"], model["revision"]) == ("org/tiny", "hub", V1)
    assert model["path"] == str(cache / "models--org--tiny" / "snapshots" / V1)


def test_the_exported_engine_runs(exported):
    from popcompile.runtime import open_session

    session = open_session(exported[1])
    result = session.generate("t1 t2 t3 t4 t5", {"max_new_tokens": 4, "greedy": True}, chat=False)[0]
    assert result.prefill == "pop" and 1 <= len(result.token_ids) <= 4


def test_offline_the_second_call_reads_the_cache(exported, server, monkeypatch):
    cache = point_at(monkeypatch, closed_port_url(), exported[0].parent, offline=True)
    asked = len(server.requests)
    source = resolve_source("org/tiny", revision="v1")
    assert (source.kind, source.revision, source.path) == ("hub", V1, str(cache / "models--org--tiny" /
                                                                            "snapshots" / V1))
    assert load_model("org/tiny", revision="v1").model.config.num_hidden_layers == 4
    with pytest.raises(ModelNotFoundError) as info:  # main was never downloaded: today's cache-only error
        resolve_source("org/tiny")
    assert "local cache only, no network: HF_HUB_OFFLINE is set" in str(info.value)
    assert len(server.requests) == asked


def test_a_cached_model_loads_when_the_hub_is_unreachable(exported, monkeypatch, caplog):
    point_at(monkeypatch, closed_port_url(), exported[0].parent)
    assert resolve_source("org/tiny", revision="v1").revision == V1
    assert re.search(r"cannot be reached \(\w+\); using the cached org/tiny \(commit", caplog.text)


def test_revision_picks_the_commit_and_a_second_call_downloads_nothing(hub, server):
    assert resolve_source("org/tiny").revision == MAIN
    assert (hub / "models--org--tiny" / "refs" / "main").read_text() == MAIN
    got = len(server.fetched("org/tiny"))
    for revision in ("v1", V1):
        source = resolve_source("org/tiny", revision=revision)
        assert source.revision == V1 and Path(source.path).name == V1
    resolve_source("org/tiny")
    assert len(server.fetched("org/tiny")) == got  # the blobs of main serve v1: same files


def test_pytorch_bin_only_without_safetensors(hub, server):
    source = resolve_source("org/bin")
    assert {"pytorch_model.bin", "config.json", "tokenizer.json"} <= snapshot_files(hub, "org/bin",
                                                                                    source.revision)
    assert "flax_model.msgpack" not in server.fetched("org/bin")


def test_an_unsupported_architecture_is_refused_before_its_weights(hub, server):
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        resolve_source("org/bert")
    assert server.fetched("org/bert", "HEAD") == {"config.json"}


@pytest.mark.parametrize("name, args, message", [
    ("org/missing", [], "model 'org/missing' was not found (HTTP 401; tried: shipped names"),
    ("org/gated", [], "org/gated is a gated model and this machine has no access (HTTP 401): accept its"),
    ("org/tiny", ["--revision", "nope"], "revision 'nope' of org/tiny does not exist on the Hugging Face"),
    ("org/huge", [], "org/huge needs 4503.6 TB in the Hugging Face cache"),
    ("org/tiny", None, "cannot reach the Hugging Face hub (http://127.0.0.1:"),  # None: nothing listens
])
def test_export_fails_in_one_line_and_writes_nothing(hub, server, cli, monkeypatch, tmp_path, name, args,
                                                     message):
    if args is None:
        args = []
        point_at(monkeypatch, closed_port_url(), hub.parent)
        skip_retry_waits(monkeypatch)
    engines = tmp_path / "engines"
    engines.mkdir()
    done = cli("export", name, "--out", engines / "engine", "--kv-calibration", "none", *args, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-1].startswith("popcompile export: error: "), done.stderr
    assert message in lines[-1]
    assert list(engines.iterdir()) == []  # no engine folder, staged folder or lock


def test_the_users_token_reaches_the_hub(hub, server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_popcompile_test")
    with pytest.raises(ModelDownloadError, match=r"\(HTTP 403\)"):
        resolve_source("org/gated")
    assert "Bearer hf_popcompile_test" in server.authorizations


@pytest.mark.parametrize("command", ["calibrate", "analyze", "eval"])
def test_every_command_downloads_at_its_revision(hub, cli, tmp_path, command):
    done = cli(command, "org/tiny", "--revision", "nope", "--out", tmp_path / "out", check=False)
    assert done.returncode == 2 and "revision 'nope' of org/tiny does not exist" in done.stderr


def test_revision_of_a_local_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="is a local folder: drop --revision"):
        resolve_source(str(tmp_path), revision="v1")


def test_no_room_names_the_cache_and_the_fix(hub):
    with pytest.raises(ModelDownloadError) as info, hub_module.explained("org/tiny", None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert f"no room to download org/tiny into the Hugging Face cache {hub}" in str(info.value)
    assert "HF_HOME" in str(info.value)


#: two exports into a Hugging Face cache on a 160 KB tmpfs, in one process: (exit code, stderr) by repo
DISK_FULL = r"""
import contextlib, io, json, sys
from popcompile.cli import main
report = {}
for name, out in zip(sys.argv[1::2], sys.argv[2::2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["export", name, "--out", out, "--kv-calibration", "none", "--min-prompt-tokens", "0"])
    report[name] = [code, err.getvalue()]
print(json.dumps(report))
"""


def _tmpfs_mount(folder: Path) -> list[str]:
    """The command prefix that runs a command with a 160 KB tmpfs on ``folder`` (user and mount namespaces:
    no root on the host); skips the test where this kernel or container forbids it."""
    prefix = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=160k popcompile-test "$0" && exec "$@"',
              str(folder)]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("no unprivileged user and mount namespaces here: a small tmpfs cannot be mounted")
    return prefix


def test_a_disk_that_fills_up(server, tmp_path):
    """A real full disk: org/tiny's listing says it needs more than the tmpfs has (refused before the
    weights); org/liar's listing under-states its shards, so the download starts and the write fails with
    ENOSPC. Both: one line, exit 2, no engine folder."""
    home = tmp_path / "hf"
    home.mkdir()
    outs = {name: tmp_path / name.replace("/", "-") for name in ("org/tiny", "org/liar")}
    done = subprocess.run([*_tmpfs_mount(home), sys.executable, "-c", DISK_FULL,
                           *(str(part) for item in outs.items() for part in item)],
                          cwd=ROOT, env=hub_env(server.url, home), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cache = home / "hub"
    expected = {"org/tiny": ("org/tiny needs ", f" in the Hugging Face cache {cache} and its disk has "),
                "org/liar": (f"no room to download org/liar into the Hugging Face cache {cache} (No space "
                             "left on device;", "point HF_HOME")}
    for name, out in outs.items():
        code, stderr = report[name]
        last = stderr.strip().splitlines()[-1]
        assert code == 2 and last.startswith("popcompile export: error: "), stderr
        assert all(part in last for part in expected[name]), last
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))
