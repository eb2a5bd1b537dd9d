"""Where a harness's HTTP client spends its time per chat request to the endpoint.

    python benchmarks/endpoint_client_cost.py --calls 400 --messages 1,7,21 --profile

A server answering ``POST /v1/chat/completions`` with a body built by the endpoint's own
``completion_body`` (a tool call and Rollway's ``rollway`` extension, as the endpoint
answers an episode's turn; no engine, so only the client's cost is measured), and a
client process (as a harness runs) that sends the same conversation ``--calls`` times,
one at a time, with each client a harness may use:

* ``aiohttp``: plain JSON over one ``aiohttp`` session (a lean client);
* ``openai``: ``AsyncOpenAI.chat.completions.create`` as harnesses call it;
* ``openai+extra_body``: the same with the conversation in ``extra_body`` and
  ``messages=[]`` as the typed argument: the SDK walks its typed arguments against its
  TypedDict unions (``async_maybe_transform``) and merges ``extra_body`` after that walk,
  so the JSON body sent is the same without the walk;
* ``openai-aiohttp`` (+``extra_body``): the SDK over its aiohttp transport
  (``DefaultAioHttpClient``);
* ``openai-sync``: the synchronous ``OpenAI`` client (what litellm calls);
* ``litellm``: ``litellm.completion(model="openai/...")``, mini-swe-agent's model call.

Per client and conversation length: the client process's CPU per call and the wall
time per call; with ``--profile`` the ``openai`` client's time split into its parts
(cProfile: the parts' shares, not their absolute time, which the profiler inflates).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harness import cpu_name, load_average, print_aligned  # noqa: E402

MODEL = "rollway-tiny"
KINDS = ("aiohttp", "openai", "openai+extra_body", "openai-aiohttp", "openai-aiohttp+extra_body", "openai-sync",
         "litellm")


def turn_message() -> dict:
    """The assistant message the server answers (a ``run`` call), as a harness appends it."""
    from sampler.openai_api.protocol import Message, ToolCallMsg

    return Message("assistant", "", (ToolCallMsg("run", '{"command": "python -m pytest -q"}', "call_" + "0" * 24),),
                   ).to_openai()


def conversation(n: int) -> list[dict]:
    """``n`` messages: the task, then (assistant call, tool reply) pairs (a harness's
    conversation after (n - 1) / 2 turns)."""
    msgs = [{"role": "user", "content": "Fix `add` in solution.py so the tests pass.\nFiles: solution.py"}]
    while len(msgs) < n:
        msgs.append(turn_message())
        msgs.append({"role": "tool", "tool_call_id": "call_" + "0" * 24,
                     "content": "F\n1 failed in 0.01s: assert add(1, 2) == 3"})
    return msgs[:n]


async def serve():
    from aiohttp import web

    from sampler.openai_api.protocol import Message, ToolCallMsg, completion_body, new_completion_id

    message = Message("assistant", "", (ToolCallMsg("run", '{"command": "python -m pytest -q"}', "call_" + "0" * 24),))

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(completion_body(
            cid=new_completion_id(), model=MODEL, message=message, finish_reason="tool_calls", prompt_tokens=80,
            completion_tokens=12, extra={"rollway": {"episode": "ep", "trajectory_id": "t", "segment_index": 0,
                                                     "new_segment": False, "weight_versions": [0] * 12,
                                                     "status": "running"}}))

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, "http://%s:%d" % runner.addresses[0][:2]


# The openai client's parts (functions of the SDK and httpx2, by cumulative time).
PARTS = {
    "request transform (async_maybe_transform)": ("_utils/_transform.py", "async_maybe_transform"),
    "build the request (_build_request)": ("_base_client.py", "_build_request"),
    "send and read (httpx2, httpcore2, anyio)": ("httpx2/_client.py", "send"),
    "parse the response (_process_response)": ("_base_client.py", "_process_response"),
}


async def client(url: str, kind: str, calls: int, n_messages: int, profile: bool) -> dict:
    messages = conversation(n_messages)
    headers = {"X-Rollway-Episode": "ep"}
    if kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession()

        async def call() -> dict:
            async with session.post(f"{url}/v1/chat/completions", headers=headers,
                                    json={"model": MODEL, "messages": messages, "max_tokens": 48}) as resp:
                return (await resp.json())["choices"][0]["message"]
    elif kind in ("openai-sync", "litellm"):
        if kind == "litellm":
            import litellm

            def sync_call() -> dict:
                r = litellm.completion(model=f"openai/{MODEL}", messages=messages, max_tokens=48, api_base=f"{url}/v1",
                                       api_key="unused", num_retries=0, extra_headers=headers)
                return r.choices[0].message.model_dump(exclude_none=True)
        else:
            from openai import OpenAI

            sync_client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

            def sync_call() -> dict:
                r = sync_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                                        extra_headers=headers)
                return r.choices[0].message.model_dump(exclude_none=True)

        async def call() -> dict:  # synchronous clients block: called inline, as a synchronous harness does
            return sync_call()
    else:
        from openai import AsyncOpenAI

        kwargs = {}
        if kind.startswith("openai-aiohttp"):
            from openai import DefaultAioHttpClient

            kwargs["http_client"] = DefaultAioHttpClient()
        oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kwargs)
        typed, extra = ([], {"messages": messages}) if kind.endswith("+extra_body") else (messages, None)

        async def call() -> dict:
            r = await oai.chat.completions.create(model=MODEL, messages=typed, max_tokens=48, extra_body=extra,
                                                  extra_headers=headers)
            return r.choices[0].message.model_dump(exclude_none=True)

    for _ in range(min(50, calls)):  # warm: imports, the connection, caches
        await call()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await call()
    out = {"cpu_ms": 1e3 * (time.process_time() - cpu0) / calls, "wall_ms": 1e3 * (time.perf_counter() - t0) / calls}
    if kind == "aiohttp":
        await session.close()
    if profile and kind.startswith("openai") and kind != "openai-sync":
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            await call()
        prof.disable()
        stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
        total = sum(v[2] for v in stats.values())
        shares = {}
        for part, (file, name) in PARTS.items():
            # A function called recursively or as a coroutine resumed many times: its
            # cumulative time counts once per outermost call in cProfile's record.
            shares[part] = sum(v[3] for (f, _, n), v in stats.items() if f.endswith(file) and n == name) / total
        out["parts"] = shares
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--messages", default="1,7,21", help="conversation lengths (messages), comma-separated")
    ap.add_argument("--clients", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--profile", action="store_true", help="split the openai clients' time into parts")
    ap.add_argument("--client", nargs=4, metavar=("URL", "KIND", "N", "PROFILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        url, kind, n, prof = args.client
        print(json.dumps(await client(url, kind, args.calls, int(n), prof == "1")), flush=True)
        return
    runner, url = await serve()
    rows, parts = [], []
    try:
        for n in map(int, args.messages.split(",")):
            for kind in args.clients.split(","):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, __file__, "--calls", str(args.calls), "--client", url, kind, str(n),
                    "1" if args.profile else "0", stdout=asyncio.subprocess.PIPE)
                out = json.loads((await proc.communicate())[0].decode().strip().splitlines()[-1])
                rows.append((n, kind, f"{out['cpu_ms']:.2f}", f"{out['wall_ms']:.2f}"))
                if "parts" in out:
                    parts.append((n, kind, *(f"{100 * v:.0f}%" for v in out["parts"].values())))
    finally:
        await runner.cleanup()
    print(f"# {cpu_name()}, load {load_average()}, {args.calls} calls one at a time per row, client in its own process")
    print_aligned(["messages", "client", "client CPU ms / call", "wall ms / call"], rows)
    if parts:
        print()
        print("# share of the openai client's profiled time (cProfile; the parts overlap nothing)")
        print_aligned(["messages", "client", *PARTS], parts)


if __name__ == "__main__":
    asyncio.run(main())
