"""A request router for POP's prefill/decode split over two vLLM servers (docs/vllm.md, "Two instances").

Start the two instances on one POP folder (``popcompile export MODEL --target vllm --out served/m``), then
the router; clients talk to the router as to one OpenAI-compatible server:

    KV='"kv_connector":"PopConnector","kv_connector_extra_config":{"shared_storage_path":"/tmp/pop-kv"}'
    vllm serve served/m --port 8100 --kv-transfer-config "{$KV,\\"kv_role\\":\\"kv_producer\\"}" &
    vllm serve served/m --port 8200 --kv-transfer-config "{$KV,\\"kv_role\\":\\"kv_consumer\\"}" &
    python samples/vllm_disagg.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    curl localhost:8000/v1/completions -d '{"model": "served/m", "prompt": "...", "max_tokens": 64}'

Per request, as vLLM's disaggregated-serving examples do: the prompt goes to the prefill instance with
``max_tokens=1`` (POP: the prompt's K/V rows land in the hand-off folder), then the unchanged request to the
decode instance, which loads those rows, runs the last prompt token through the full model and generates.
Its answer is single-instance POP's (tests_vllm/test_vllm_disagg.py).

Limits: one prefill and one decode server; the whole answer is returned at once (``"stream": true`` is
refused); prompts are handed over through a shared folder (PopConnector), so both servers must see it.
Standard library only.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def route(path: str, body: dict, prefill: str, decode: str, timeout: float) -> tuple[int, bytes]:
    """Prefill with max_tokens=1, then decode the unchanged request; an error of either is the answer."""
    if body.get("stream"):
        return 400, json.dumps({"error": {"message": "this router returns whole answers: drop \"stream\""}}
                               ).encode()
    first = {**body, "max_tokens": 1, "max_completion_tokens": 1}
    status, answer = post(prefill + path, first, timeout)
    if status != 200:
        return status, answer
    return post(decode + path, body, timeout)


def handler(prefill: str, decode: str, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Router(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path not in ROUTES:
                return self._reply(404, json.dumps({"error": {"message": f"routes: {', '.join(ROUTES)}"}}
                                                   ).encode())
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError:
                return self._reply(400, b'{"error": {"message": "the body is not JSON"}}')
            self._reply(*route(self.path, body, prefill, decode, timeout))

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                return self._reply(*both_healthy(prefill, decode, timeout))
            self._reply(404, b"{}")

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            return

    return Router


def both_healthy(prefill: str, decode: str, timeout: float) -> tuple[int, bytes]:
    """200 when both instances answer /health."""
    for base in (prefill, decode):
        try:
            with urllib.request.urlopen(base + "/health", timeout=timeout):
                pass
        except OSError:
            return 503, json.dumps({"error": {"message": f"{base} is not up"}}).encode()
    return 200, b"{}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL (kv_producer)")
    parser.add_argument("--decode", required=True, help="the decode instance's base URL (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per instance call")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port),
                                 handler(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout))
    print(f"routing http://{args.host}:{args.port} -> prefill {args.prefill}, decode {args.decode}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
