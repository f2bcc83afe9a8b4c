"""HTTPReward and JudgeReward against a small server this test starts on 127.0.0.1: success,
a timeout, a 500 then success (retried), a 500 every time, malformed JSON, the wrong number of
scores, and a judge's reply parsed into a score (:mod:`periodic_rl.remote_rewards`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from periodic_rl.remote_rewards import HTTPReward, JudgeReward
from periodic_rl.rewards import RewardError
from periodic_rl.scoring import Scorer

PROMPTS = ["What is 2+2?", [{"role": "user", "content": "And 3+3?"}]]
COMPLETIONS = ["4", "six"]
COLUMNS = {"answer": ["4", "6"]}


class Verifier:
    """The server's script: each request takes the next reply (the last one repeats), as
    ``(status, body, delay_s)``; ``requests`` keeps what came in, with the time."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, str, float]] = []
        self.requests: list[tuple[str, dict, float]] = []
        self.release = threading.Event()  # ends a slow reply's wait at teardown

    def handler(self) -> type[BaseHTTPRequestHandler]:
        verifier = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                verifier.requests.append((self.path, body, time.monotonic()))
                script = verifier.replies
                status, text, delay = script[min(len(verifier.requests), len(script)) - 1]
                verifier.release.wait(delay)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, *args) -> None:
                pass

        return Handler


@pytest.fixture
def verifier() -> Iterator[tuple[Verifier, str]]:
    script = Verifier()
    server = ThreadingHTTPServer(("127.0.0.1", 0), script.handler())
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield script, f"http://127.0.0.1:{server.server_address[1]}"
    script.release.set()
    server.shutdown()
    server.server_close()


def test_posts_prompts_completions_columns_and_reads_the_scores(verifier):
    script, url = verifier
    script.replies = [(200, "[1.0, 0.25]", 0)]
    reward = HTTPReward(f"{url}/score", name="verifier")
    assert reward(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 0.25]
    path, body, _ = script.requests[0]
    assert path == "/score"
    assert body == {"prompts": PROMPTS, "completions": COMPLETIONS, "columns": COLUMNS}
    scored = Scorer(tokenizer=None, reward_funcs=[reward], reward_weights=[1.0])
    assert scored.rewards(PROMPTS, COMPLETIONS, COLUMNS)[1] == {"verifier": [1.0, 0.25]}


def test_named_components_from_the_verifier(verifier):
    script, url = verifier
    script.replies = [(200, '{"format": [1, 1], "correct": [1, 0]}', 0)]
    s = Scorer(tokenizer=None, reward_funcs=[HTTPReward(url)], reward_weights=[1.0])
    totals, components = s.rewards(PROMPTS, COMPLETIONS, COLUMNS)
    assert components == {"format": [1.0, 1.0], "correct": [1.0, 0.0]}
    assert totals == [2.0, 1.0]


def test_a_500_then_success_is_retried_with_backoff(verifier):
    script, url = verifier
    script.replies = [(500, "oops", 0), (503, "busy", 0), (200, "[0.5, 0.5]", 0)]
    reward = HTTPReward(url, retries=3, backoff_s=0.2)
    assert reward(PROMPTS, COMPLETIONS) == [0.5, 0.5]
    times = [t for _, _, t in script.requests]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4  # doubled


def test_a_500_every_time_fails_after_the_retries(verifier):
    script, url = verifier
    script.replies = [(500, "database down", 0)]
    with pytest.raises(RewardError, match=r"failed 3 times \(the last: HTTP 500: 'database down'"):
        HTTPReward(url, retries=2, backoff_s=0.01)(PROMPTS, COMPLETIONS)
    assert len(script.requests) == 3


def test_a_timeout_is_retried_then_fails(verifier):
    script, url = verifier
    script.replies = [(200, "[1, 1]", 5.0)]
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"failed 2 times \(the last: .*timed out"):
        HTTPReward(url, timeout_s=0.3, retries=1, backoff_s=0.01)(PROMPTS, COMPLETIONS)
    assert time.monotonic() - started < 4.0  # each try stopped at its timeout, not the reply
    assert len(script.requests) == 2


def test_a_timeout_then_success(verifier):
    script, url = verifier
    script.replies = [(200, "[0, 0]", 5.0), (200, "[1, 1]", 0)]
    assert HTTPReward(url, timeout_s=0.3, retries=1, backoff_s=0.01)(PROMPTS, COMPLETIONS) == [1, 1]


def test_a_client_error_is_not_retried(verifier):
    script, url = verifier
    script.replies = [(404, "no such route", 0)]
    with pytest.raises(RewardError, match="answered HTTP 404: 'no such route'; check the URL"):
        HTTPReward(url, retries=3)(PROMPTS, COMPLETIONS)
    assert len(script.requests) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[1.0, 0.5", "answered malformed JSON"),
        ("[1.0]", "answered 1 scores for 2 completions"),
        ('{"score": 1}', "answered 1 for 'score' for 2 completions"),
    ],
)
def test_malformed_or_wrong_length_answers_are_clear_errors(verifier, body, message):
    script, url = verifier
    script.replies = [(200, body, 0)]
    with pytest.raises(RewardError, match=message) as caught:
        HTTPReward(url, retries=3)(PROMPTS, COMPLETIONS)
    assert url in str(caught.value)
    assert len(script.requests) == 1  # not retried: the server answered


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="url must be an http:// or https:// URL"):
        HTTPReward("file:///etc/passwd")
    with pytest.raises(ValueError, match="retries must be an integer >= 0"):
        HTTPReward("http://127.0.0.1:1", retries=-1)
    with pytest.raises(ValueError, match=r"must contain \{completion\}"):
        JudgeReward("http://127.0.0.1:1", model="m", prompt_template="Rate {prompt}")


def _chat(content: str) -> str:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})


def test_a_judge_reply_is_parsed_into_a_score(verifier, monkeypatch):
    script, url = verifier
    script.replies = [(200, _chat("Reasoning... the answer is right.\nScore: 8"), 0)]
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge = JudgeReward(
        f"{url}/v1",
        model="judge-model",
        prompt_template="Q: {prompt}\nA: {completion}\nExpected: {answer}\nScore 0-10:",
        api_key_env="JUDGE_KEY",
        concurrency=2,
    )
    assert judge(PROMPTS, COMPLETIONS, **COLUMNS) == [0.8, 0.8]
    paths = {path for path, _, _ in script.requests}
    assert paths == {"/v1/chat/completions"}
    sent = sorted(body["messages"][0]["content"] for _, body, _ in script.requests)
    assert sent == ["Q: And 3+3?\nA: six\nExpected: 6\nScore 0-10:",
                    "Q: What is 2+2?\nA: 4\nExpected: 4\nScore 0-10:"]  # fmt: skip
    assert all(body["model"] == "judge-model" for _, body, _ in script.requests)


def test_a_judge_reply_without_a_score_or_not_a_chat_completion(verifier):
    script, url = verifier
    judge = JudgeReward(url, model="m", max_score=None)
    script.replies = [(200, _chat("I cannot grade this."), 0)]
    with pytest.raises(
        RewardError, match="the judge's reply has no score .*'I cannot grade this.'"
    ):
        judge(PROMPTS[:1], COMPLETIONS[:1])
    script.replies = [(200, '{"error": "model not found"}', 0)]
    with pytest.raises(RewardError, match="not a chat completion"):
        judge(PROMPTS[:1], COMPLETIONS[:1])
    with pytest.raises(RewardError, match=r"prompt_template names 'answer'"):
        JudgeReward(url, model="m", prompt_template="{completion} vs {answer}")(
            PROMPTS[:1], COMPLETIONS[:1]
        )
