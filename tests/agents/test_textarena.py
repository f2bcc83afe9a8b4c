"""textarena's games run unchanged as environments: a real game (``GuessTheNumber-v0``)
played by a strategy through the adapter, then by the tiny model through the agent loop."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("textarena", reason="the agents extra (textarena) is not installed")

from periodic_rl.agents.textarena import TextArenaGame  # noqa: E402

GAME = "GuessTheNumber-v0"


def test_binary_search_wins_the_game_through_the_adapter():
    game = TextArenaGame(GAME)
    first = game.reset({"prompt": "play"}, seed=3)
    assert first.startswith("[GAME]") and "[5]" in first  # the game's own instructions
    low, high, turns = 1, 20, 0
    while True:
        guess = (low + high) // 2
        observation, reward, done = game.step(f"I guess [{guess}]")
        turns += 1
        if done:
            break
        assert observation.startswith("[GAME]") and first not in observation  # new text only
        if "higher" in observation.lower():
            low = guess + 1
        else:
            assert "lower" in observation.lower(), observation
            high = guess - 1
    assert reward == 1.0 and turns <= 5


def test_the_same_seed_hides_the_same_number_and_a_bad_move_is_answered():
    def secret(seed: int) -> int:
        game = TextArenaGame(GAME)
        game.reset({}, seed=seed)
        for guess in range(1, 21):
            _, reward, done = game.step(f"[{guess}]")
            if done and reward == 1.0:
                return guess
        raise AssertionError("never found")

    assert secret(11) == secret(11)
    game = TextArenaGame(GAME)
    game.reset({}, seed=0)
    observation, reward, done = game.step("no number here")
    assert not done and reward == 0.0 and "invalid move" in observation.lower()


def test_the_model_plays_it_through_the_agent_loop(tiny_llama_path):
    from transformers import AutoTokenizer

    from periodic_rl.agents.build import agent_loop
    from periodic_rl.agents.config import AgentConfig
    from periodic_rl.agents.prompts import job_row
    from periodic_rl.rollout.engines.hf_engine import HFEngine
    from periodic_rl.rollout.types import GroupJob, SamplingConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    config = AgentConfig(
        environment="periodic_rl.agents.textarena:TextArenaGame",
        environment_kwargs={"env_id": GAME},
        max_turns=3,
        max_turn_tokens=4,
    )
    loop = agent_loop(config, tokenizer, {tokenizer.eos_token_id})
    row = job_row({"prompt": "Let us play."}, None)
    prompt_ids = loop.renderer.prompt_ids(row["prompt"], add_generation_prompt=False)
    job = GroupJob(index=0, prompt_ids=prompt_ids, n=2, seed=5, row=row)
    (out,) = loop.run(HFEngine(tiny_llama_path), [job], SamplingConfig(max_new_tokens=12))
    for ids, trajectory in zip(out.completions, out.trajectories, strict=True):
        loop.renderer.check_whole(row["prompt"], trajectory.messages, prompt_ids + ids)
        assert re.search(r"\[GAME\].*\[5\]", trajectory.messages[0]["content"], re.DOTALL)
        # a random model rarely writes "[number]": the game answers each invalid move
        assert trajectory.stop in ("done", "max_turns") and len(trajectory.turns) > 1
        assert "invalid move" in trajectory.messages[2]["content"].lower()
