"""`/v1/messages` through the whole swarm server, in process, with the official SDK.

The server is `create_app(settings)` behind a `TestClient` (the Anthropic SDK takes it as
its `http_client`), so the credential gate, the episode lane, the body bound and the
gateway are the real ones; its gateway forwards over a real Unix socket to the engine's
own channel app, which renders with ajet-tiny's tokenizer and template and answers from a
scripted generator (`ScriptedGenerator`). The replies are scripted; everything between
the SDK and the generator is production code. The real engine and model are in
`tests/tool_agents/test_messages_clients.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.plane.app import create_channel_app
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.tiny import TinySpec, ensure_tiny_model
from ajet.engine.transport.unix_server import ChannelServer
from ajet.protocol import BeginEpisodeRequest, BeginEpisodeResponse, EngineState
from swarm_server.main import create_app
from swarm_server.settings import Settings
from tests.support.engine import ScriptedGenerator
from tests.support.claude_code import TOOL_NAMES, claude_code_body, claude_code_headers

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BASH_CALL = ('<tool_call>\n{"name": "Bash", "arguments": {"command": "pytest -q '
             'tests/test_parser.py", "description": "Run the failing test"}}\n</tool_call>')
WEATHER = {"name": "get_weather", "description": "Get the weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
#: the server's body bound: a Claude Code turn (77 KB) fits, 4x that does not
MAX_JSON_BYTES = 200_000
#: a longer-context ajet-tiny (same tokenizer and template): 128k positions, so that a
#: Claude Code prompt (~77k tokens at one character per token) fits its context
LONG_CONTEXT = TinySpec(max_position_embeddings=131_072)
WORKER_TOKEN = "worker-token-for-messages"
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}


@dataclass
class StandInEngine:
    """What the gateway sees of the runs (`RunsView`): one rolling run."""

    socket: Path
    state: EngineState = EngineState.ROLLING
    steps: list[int] = field(default_factory=lambda: [0])

    def default_run_id(self) -> str | None:
        return "run-messages"

    def serving_socket(self, run_id: str) -> Path | None:
        return self.socket if run_id == "run-messages" else None

    def run_step(self, run_id: str) -> int | None:
        return self.steps[-1]

    def resolve(self, ref: str) -> str:
        return ref

    def live_state(self, run_id: str | None) -> EngineState | None:
        return self.state

    def describe(self, run_id: str | None) -> str:
        return f"engine is {self.state}"


@dataclass
class Plane:
    http: TestClient
    generator: ScriptedGenerator
    plane: EpisodePlane
    max_positions: int

    def begin(self) -> BeginEpisodeResponse:
        r = self.http.post("/begin_episode", json={}, headers=WORKER)
        assert r.status_code == 200, r.text
        return BeginEpisodeResponse.model_validate(r.json())

    def sdk(self, episode: BeginEpisodeResponse, **kwargs: Any) -> anthropic.Anthropic:
        kwargs.setdefault("api_key", episode.openai_api_key)
        return anthropic.Anthropic(base_url=episode.anthropic_base_url, max_retries=0,
                                   http_client=self.http, **kwargs)

    def completions(self, episode: BeginEpisodeResponse) -> list[Any]:
        return list(self.plane.registry._live[episode.episode_uuid].trajectory.completions)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    from transformers import AutoConfig, AutoTokenizer

    root = tmp_path_factory.mktemp("msg")
    model = ensure_tiny_model(root, seed=0, spec=LONG_CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = engine_config_from_job(AgentJetJob(batch_size=1, num_repeat=2, max_new_tokens=64,
                                             max_response_length=256,
                                             max_prompt_length=100_000),
                                 cuda_devices=0, cpu_count=1)
    registry = EpisodeRegistry(group_size=2, max_in_flight=64, default_timeout_s=60)
    registry.set_state(EngineState.ROLLING)
    generator = ScriptedGenerator(tokenizer, eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    generator.max_positions = AutoConfig.from_pretrained(model).max_position_embeddings
    plane = EpisodePlane(cfg=cfg, registry=registry, run_id="run-messages", ajet_file="x")
    plane.set_policy(SimpleNamespace(tokenizer=tokenizer), generator)  # type: ignore[arg-type]
    channel = ChannelServer(create_channel_app(plane), root / "engine.sock")
    channel.start()
    app = create_app(Settings(workdir=root / "swarm", max_json_bytes=MAX_JSON_BYTES,
                              token="control-token-for-messages",
                              worker_token=WORKER_TOKEN))
    app.state.ctx.episodes.runs = StandInEngine(root / "engine.sock")
    try:
        with TestClient(app) as http:
            yield Plane(http, generator, plane, generator.max_positions)
    finally:
        channel.stop()


# ---------------------------------------------------------------------------- the SDK


def test_begin_episode_gives_the_anthropic_base_url(srv: Plane) -> None:
    episode = srv.begin()
    assert episode.anthropic_base_url == "http://testserver"
    assert episode.openai_base_url == f"{episode.anthropic_base_url}/v1"


def test_sdk_create_with_x_api_key_and_bearer(srv: Plane) -> None:
    episode = srv.begin()
    srv.generator.replies += ["Hello from the policy.", "Again and again."]
    message = srv.sdk(episode).messages.create(
        model="claude-sonnet-4-5", max_tokens=64, system="Be brief.",
        messages=[{"role": "user", "content": "Say hello."}])
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello from the policy."
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    (completion,) = srv.completions(episode)
    assert message.usage.input_tokens == len(completion.prompt_ids)
    assert message.usage.output_tokens == len(completion.response_ids)
    # the SDK's auth_token is sent as Authorization: Bearer
    bearer = anthropic.Anthropic(base_url=episode.anthropic_base_url, auth_token=episode
                                 .openai_api_key, max_retries=0, http_client=srv.http,
                                 default_headers={"anthropic-version": "2025-01-01"})
    again = bearer.messages.create(model="m", max_tokens=5,
                                   messages=[{"role": "user", "content": "again"}])
    assert again.content[0].text == "Again" and again.stop_reason == "max_tokens"
    assert len(srv.completions(episode)) == 2


def test_sdk_stream_and_its_final_message(srv: Plane) -> None:
    episode = srv.begin()
    srv.generator.replies.append("It is sunny in Paris.")
    with srv.sdk(episode).messages.stream(
            model="m", max_tokens=64,
            messages=[{"role": "user", "content": "Weather?"}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    # token by token: one text delta per character token
    assert "".join(pieces) == "It is sunny in Paris." and len(pieces) == 21
    assert final.content[0].text == "It is sunny in Paris." and final.stop_reason == "end_turn"
    (completion,) = srv.completions(episode)
    assert final.usage.input_tokens == len(completion.prompt_ids)
    assert final.usage.output_tokens == len(completion.response_ids) == 22


def test_sdk_tools_with_a_tool_result_follow_up(srv: Plane) -> None:
    episode = srv.begin()
    client = srv.sdk(episode)
    srv.generator.replies += [CALL_TEXT, "It is sunny in Paris."]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.messages.create(model="m", max_tokens=128, tools=[WEATHER],
                                    tool_choice={"type": "auto"}, messages=[question])
    assert called.stop_reason == "tool_use"
    (use,) = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    # the follow-up sends the SDK's own content blocks back, as the tutorials do
    answer = client.messages.create(model="m", max_tokens=128, tools=[WEATHER], messages=[
        question, {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 24 C"}]}])
    assert answer.content[0].text == "It is sunny in Paris."
    first, second = srv.completions(episode)
    # the second prompt extends the first prompt and the tokens sampled for it (the tool
    # call, end of turn included): what merges an episode's calls into one timeline
    head = (*first.prompt_ids, *first.response_ids)
    assert second.prompt_ids[:len(head)] == head
    counted = client.messages.count_tokens(model="m", tools=[WEATHER], messages=[question])
    assert counted.input_tokens == len(first.prompt_ids)


def test_sdk_error_types(srv: Plane) -> None:
    episode = srv.begin()
    client = srv.sdk(episode)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    body = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"] and "(hint: " in body["error"]["message"]
    assert body["param"] == "messages[0].content[0].type"
    with pytest.raises(anthropic.UnprocessableEntityError):
        client.messages.create(model="m", max_tokens=0,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        srv.sdk(episode, api_key="ajep_forged.key").messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    # the credential gate refuses before the body is read, in Anthropic's shape too
    nobody = srv.http.post("/v1/messages", json={"max_tokens": 8, "messages": []})
    assert nobody.status_code == 401 and nobody.json()["type"] == "error"
    assert nobody.json()["hint"]
    with pytest.raises(anthropic.APIStatusError) as too_large:
        client.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "x" * (MAX_JSON_BYTES + 1)}])
    assert too_large.value.status_code == 413
    assert too_large.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.list()
    assert missing.value.body["type"] == "error"
    # the OpenAI routes keep OpenAI's shape
    chat = srv.http.post("/v1/chat/completions", headers={"x-api-key": "ajep_x.y"}, json={})
    assert chat.status_code == 401 and "code" in chat.json()["error"]


def test_an_episode_that_ended_refuses_its_key(srv: Plane) -> None:
    episode = srv.begin()
    srv.generator.replies.append("done")
    client = srv.sdk(episode)
    client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    r = srv.http.post("/end_episode", headers=WORKER,
                      json={"episode_uuid": episode.episode_uuid, "task_id": "t", "reward": 1.0})
    assert r.status_code == 200, r.text
    with pytest.raises(anthropic.AuthenticationError) as ended:
        client.messages.create(model="m", max_tokens=8,
                               messages=[{"role": "user", "content": "x"}])
    assert "ended" in ended.value.body["error"]["message"]


# ---------------------------------------------------------------------------- Claude Code


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_a_claude_code_turn_is_accepted_streamed_and_recorded(srv: Plane) -> None:
    episode = srv.begin()
    body = claude_code_body()
    raw = json.dumps(body).encode()
    assert 75_000 < len(raw) < 80_000 and len(body["tools"]) == 24
    srv.generator.replies.append("I'll run the test first.\n" + BASH_CALL)
    headers = claude_code_headers(episode.openai_api_key)
    r = srv.http.post("/v1/messages?beta=true", headers=headers, content=raw)
    assert r.status_code == 200, r.text[:2000]
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" in kinds
    tool = [d["content_block"] for k, d in events if k == "content_block_start"][-1]
    assert tool["type"] == "tool_use" and tool["name"] == "Bash"
    arguments = "".join(d["delta"].get("partial_json", "") for k, d in events
                        if k == "content_block_delta")
    assert json.loads(arguments)["command"] == "pytest -q tests/test_parser.py"
    end = dict(events)["message_delta"]
    assert end["delta"]["stop_reason"] == "tool_use"
    assert end["usage"]["max_tokens_clamped"] == {"requested": 32000, "served": 256}
    (completion,) = srv.completions(episode)
    # recorded like a chat: the whole rendered prompt (every tool's schema in it), the
    # sampled tokens and their log-probs
    assert 70_000 < len(completion.prompt_ids) < srv.max_positions
    assert len(completion.prompt_ids) > 16_384  # past ajet-tiny's own context
    prompt = srv.plane.chat_format.tokenizer.decode(completion.prompt_ids)  # type: ignore
    assert all(f'"name": "{name}"' in prompt for name in TOOL_NAMES)
    assert len(completion.logprobs) == len(completion.response_ids)
    assert end["usage"]["input_tokens"] == len(completion.prompt_ids)
    # its count_tokens call (no stream, no max_tokens) counts the same prompt
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream",
                                                         "temperature", "metadata")}
    counted = srv.http.post("/v1/messages/count_tokens?beta=true", headers=headers, json=count)
    assert counted.json() == {"input_tokens": len(completion.prompt_ids)}


def test_ajet_tiny_context_does_not_hold_a_claude_code_prompt(srv: Plane,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setattr(srv.generator, "max_positions", TinySpec().max_position_embeddings)
    episode = srv.begin()
    r = srv.http.post("/v1/messages?beta=true", json=claude_code_body(stream=False),
                      headers=claude_code_headers(episode.openai_api_key))
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "context is 16384" in r.json()["error"]["message"]


def test_messages_routes_are_in_the_schema(srv: Plane) -> None:
    paths = srv.http.get("/openapi.json", headers=WORKER).json()["paths"]
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(paths)


def test_the_root_answers_an_episode_key_as_claude_code_probes_it(srv: Plane) -> None:
    episode = srv.begin()
    probe = srv.http.get("/", headers=claude_code_headers(episode.openai_api_key))
    assert probe.status_code == 200 and "/v1/messages" in probe.json()["episode_plane"]["routes"]
    assert srv.http.get("/", headers=WORKER).status_code == 200
    for refused in ({"x-api-key": "ajep_forged.key"}, {}):
        assert srv.http.get("/", headers=refused).status_code == 401


def test_an_engine_without_the_route_is_a_404_and_the_episode_lives_on(tmp_path: Path) -> None:
    """An engine running code from before the Messages API (its routes 404): the episode
    is not taken for closed."""
    import asyncio

    from ajet.errors import SwarmNotFound
    from tests.support.gateway import gateway_on

    async def scenario() -> None:
        async with gateway_on(tmp_path) as (gateway, _):
            episode = await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            with pytest.raises(SwarmNotFound) as missing:
                await gateway.openai(episode.episode_uuid, method="POST",
                                     path="/v1/messages", body=b"{}")
            assert "predates" in str(missing.value.detail)
            assert gateway.check_key(episode.openai_api_key) == episode.episode_uuid

    asyncio.run(scenario())
