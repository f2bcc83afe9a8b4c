"""Rewards computed by a server: an HTTP verifier (:class:`HTTPReward`) and an LLM judge behind
any OpenAI-compatible endpoint (:class:`JudgeReward`: vLLM's ``vllm serve``, SGLang, a hosted
API).

Both are reward objects: give them to ``reward_funcs`` in Python, or from YAML by class path::

    reward_funcs:
      - class_path: periodic_rl.remote_rewards.HTTPReward
        init_args: {url: "http://127.0.0.1:8080/score", timeout_s: 30}
      - class_path: periodic_rl.remote_rewards.JudgeReward
        init_args: {base_url: "http://127.0.0.1:8000", model: Qwen/Qwen2.5-7B-Instruct}

Each request is retried on a connection error, a timeout, HTTP 429 or a 5xx answer, after
``backoff_s``, then twice that, and so on (``retries`` retries); any other answer that is not
what was asked (a 4xx, malformed JSON, the wrong number of scores, a judge reply without a
score) is a :class:`~periodic_rl.rewards.RewardError` naming the URL and what came back, which
``reward_on_error`` then handles like any failing reward. They run in the reward pool
(:mod:`periodic_rl.reward_pool`), so ``reward_timeout_s`` bounds a whole call, retries included.
"""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from periodic_rl.rewards import RewardError, as_text, snippet

RETRY_STATUS = 429  # "too many requests": retried, as a 5xx is

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}"
    "\n\nRate the answer from 0 (wrong or useless) to 10 (correct and complete). Reply with the "
    "number only."
)


def post_json(
    url: str,
    payload: Any,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """POST ``payload`` as JSON to ``url`` and return the JSON answer, retrying with exponential
    backoff on connection errors, timeouts, 429 and 5xx (see the module's docstring)."""
    body = json.dumps(payload, default=str).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=body, headers=sent, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = snippet(error.read().decode(errors="replace"), 200)
            if error.code >= 500 or error.code == RETRY_STATUS:
                last = f"HTTP {error.code}: {detail!r}"
                continue
            raise RewardError(
                f"{url} answered HTTP {error.code}: {detail!r}; check the URL, the request "
                "format it expects and any key it needs"
            ) from error
        except (OSError, urllib.error.URLError) as error:  # refused, reset, timed out
            last = f"{type(error).__name__}: {getattr(error, 'reason', error)}"
            continue
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise RewardError(
                f"{url} answered malformed JSON ({error}): "
                f"{snippet(text.decode(errors='replace'), 200)!r}"
            ) from error
    raise RewardError(
        f"{url} failed {retries + 1} times (the last: {last}); is the server up and reachable? "
        "(retries and backoff_s set how long to keep trying)"
    )


def _check_url(url: Any, what: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{what} must be an http:// or https:// URL, got {url!r}")
    return url


def _check_retry(timeout_s: Any, retries: Any, backoff_s: Any) -> None:
    if not isinstance(timeout_s, int | float) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    if not isinstance(backoff_s, int | float) or not 0 <= backoff_s < float("inf"):
        raise ValueError(f"backoff_s must be a finite number of seconds >= 0, got {backoff_s!r}")


class HTTPReward:
    """A verifier behind an HTTP endpoint: each call POSTs ``{"prompts": [...], "completions":
    [...], "columns": {name: [...]}}`` (one entry per completion, as a reward function gets them)
    to ``url`` and reads back a JSON list of one number per completion, or an object of named
    components ``{"format": [...], "correct": [...]}``.

    Args:
        url: the endpoint (http or https).
        timeout_s: the longest one request may take.
        retries, backoff_s: retries after a connection error, a timeout, 429 or 5xx, waiting
            ``backoff_s * 2**k`` before the k-th retry.
        headers: extra request headers (e.g. an authorization the verifier needs).
        name: the name its values are logged under (``rewards/<name>``).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
        name: str = "http_reward",
    ) -> None:
        self.url = _check_url(url, "HTTPReward's url")
        _check_retry(timeout_s, retries, backoff_s)
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.headers = dict(headers or {})
        self.__name__ = name

    def __call__(self, prompts: list[Any], completions: list[str], **columns: Any) -> Any:
        payload = {"prompts": prompts, "completions": completions, "columns": columns}
        reply = post_json(
            self.url, payload, self.timeout_s, self.retries, self.backoff_s, self.headers
        )
        parts = reply if isinstance(reply, dict) else {"": reply}
        for part, values in parts.items():
            if not isinstance(values, list) or len(values) != len(completions):
                got = f"{len(values)} scores" if isinstance(values, list) else repr(values)[:100]
                where = f" for '{part}'" if part else ""
                raise RewardError(
                    f"{self.url} answered {got}{where} for {len(completions)} completions; the "
                    "verifier must return a JSON list of one number per completion (or an "
                    "object of such lists, one per named component)"
                )
        return reply


class JudgeReward:
    """An LLM judge behind an OpenAI-compatible server: for each completion it asks
    ``{base_url}/v1/chat/completions`` (requests in parallel, ``concurrency`` at a time) with
    ``prompt_template`` filled in, and reads the score from the reply: the last number matching
    ``score_pattern``, divided by ``max_score``.

    Args:
        base_url: the server (``http://127.0.0.1:8000``; a trailing ``/v1`` is accepted).
        model: the model name the server knows.
        prompt_template: the judge's user message, a ``str.format`` template with
            ``{completion}``, and optionally ``{prompt}`` and any dataset column by name.
        score_pattern: a regular expression; the last match in the reply is the score.
        max_score: the score is divided by it (10: the default template's scale; None: raw).
        api_key_env: the environment variable holding the server's key, sent as a bearer
            token when set (the key itself is never part of the configuration).
        temperature, max_tokens: the judge's sampling.
        timeout_s, retries, backoff_s: per request, as for :class:`HTTPReward`.
        name: the name its values are logged under (``rewards/<name>``).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt_template: str = DEFAULT_JUDGE_TEMPLATE,
        score_pattern: str = r"-?\d+(?:\.\d+)?",
        max_score: float | None = 10.0,
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 16,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        name: str = "judge",
    ) -> None:
        base = _check_url(base_url, "JudgeReward's base_url").rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        fields = {f for _, f, _, _ in string.Formatter().parse(prompt_template) if f}
        if "completion" not in fields:
            raise ValueError(
                "JudgeReward's prompt_template must contain {completion} (and may contain "
                f"{{prompt}} and dataset columns), got {prompt_template!r}"
            )
        re.compile(score_pattern)
        _check_retry(timeout_s, retries, backoff_s)
        if max_score is not None and not max_score > 0:
            raise ValueError(f"max_score must be > 0, or null for the raw score; got {max_score}")
        self.model, self.prompt_template, self.score_pattern = model, prompt_template, score_pattern
        self.max_score, self.api_key_env = max_score, api_key_env
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.concurrency = max(1, concurrency)
        self.__name__ = name

    def __call__(self, prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
        messages = [self.message(prompts, completions, columns, i) for i in range(len(prompts))]
        with ThreadPoolExecutor(min(self.concurrency, max(1, len(messages)))) as pool:
            replies = list(pool.map(self.ask, messages))
        return [self.parse(reply) for reply in replies]

    def message(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]], i: int
    ) -> str:
        """The judge's user message for completion ``i``."""
        fields = {name: values[i] for name, values in columns.items()}
        try:
            return self.prompt_template.format(
                **{**fields, "prompt": as_text(prompts[i]), "completion": completions[i]}
            )
        except (KeyError, IndexError) as error:
            raise RewardError(
                f"JudgeReward's prompt_template names {error} but the rows have only the "
                f"columns {sorted(columns)} (besides prompt and completion)"
            ) from error

    def ask(self, content: str) -> str:
        """The judge's reply to one user message."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        reply = post_json(self.url, payload, self.timeout_s, self.retries, self.backoff_s, headers)
        try:
            return str(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError) as error:
            raise RewardError(
                f"{self.url} answered {snippet(json.dumps(reply), 200)!r}, not a chat completion "
                "(choices[0].message.content); is it an OpenAI-compatible server?"
            ) from error

    def parse(self, reply: str) -> float:
        """The score in a judge's reply (see the class docstring)."""
        found = re.findall(self.score_pattern, reply)
        if not found:
            raise RewardError(
                f"the judge's reply has no score matching {self.score_pattern!r}: "
                f"{snippet(reply, 200)!r}; make prompt_template ask for the number only, or "
                "adapt score_pattern"
            )
        last = found[-1]
        score = float(last if isinstance(last, str) else last[0])
        return score / self.max_score if self.max_score is not None else score
