"""Language environments of several turns (rltrain.llm.environments) and the tools a model calls
(rltrain.llm.tools): the call syntax, tools run in a process of their own and cut at their timeout, the
built-in tool env and game, and the refusals."""

from __future__ import annotations

from itertools import takewhile

import pytest
import torch

from rltrain.errors import ConfigError
from rltrain.llm.environments import GuessNumber, ToolEnv, check_interface
from rltrain.llm.tasks import Task
from rltrain.llm.tools import (
    TEMPLATE_SYNTAX,
    ToolError,
    ToolRunner,
    calculator,
    load_tools,
    lookup,
    parse_calls,
    parse_template_calls,
)

TOOLS = {"lookup": lookup, "calculator": calculator}


def test_calls_are_parsed_in_order_and_a_call_that_cannot_run_says_why():
    calls = parse_calls("first <tool>lookup(k3)</tool> then <tool> calculator( 2*(3+4), 1 ) </tool> done", TOOLS)
    assert [(c.name, c.arguments, c.problem) for c in calls] == [("lookup", ("k3",), None),
                                                                 ("calculator", ("2*(3+4), 1",), None)]
    assert parse_calls("no call here, <tool>lookup(k3)", TOOLS) == []  # unclosed: not a call
    [unknown, bad, empty] = parse_calls("<tool>search(x)</tool><tool>lookup k3</tool><tool>lookup()</tool>", TOOLS)
    assert unknown.problem == "no tool 'search'; the tools are calculator, lookup"
    assert bad.problem == "a call is written <tool>NAME(ARGUMENTS)</tool>"
    assert empty.problem == "lookup takes 1 argument, got 0"


def test_template_calls_are_tagged_objects_or_as_llama_3_1_writes_them_a_turn_of_one_object():
    tagged = ('<tool_call>{"name": "lookup", "arguments": {"key": "k3"}}</tool_call> and '
              '<tool_call>{"name": 5}</tool_call>')
    [good, bad] = parse_template_calls(tagged, TOOLS)
    assert (good.name, good.arguments, good.problem) == ("lookup", (("key", "k3"),), None)
    assert bad.problem.startswith('a call is written <tool_call>{"name": NAME')
    [bare] = parse_template_calls(' {"name": "lookup", "parameters": {"key": "k3"}}\n', TOOLS)  # Llama 3.1's
    assert (bare.text, bare.name, bare.arguments, bare.problem) == (
        '{"name": "lookup", "parameters": {"key": "k3"}}', "lookup", (("key", "k3"),), None)
    [wrong] = parse_template_calls('{"name": "lookup", "parameters": {"k": 1}}', TOOLS)
    assert wrong.problem == "lookup: missing a required argument: 'key'"
    [broken] = parse_template_calls('{"name": "lookup", "parameters": {"key": "k3"}', TOOLS)  # a call, cut short
    assert broken.problem.startswith("a call is written")
    # an answer is no call: text around an object, or an object that names nothing
    assert parse_template_calls('the value is {"name": "lookup"}', TOOLS) == []
    assert parse_template_calls('{"value": 58}', TOOLS) == []


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculator("2*(3+4) - 10/4") == "11.5" and calculator("7//2") == "3" and calculator("-2**3") == "-8"
    for bad in ("__import__('os')", "2**1000", "x+1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tools_run_in_a_process_of_their_own_errors_are_observations_and_a_hang_is_cut():
    runner = ToolRunner(["rltrain.llm.tools.lookup", "tests.parts_for_tests.tool_that_raises",
                         "tests.parts_for_tests.tool_that_hangs", "tests.parts_for_tests.tool_that_exits"],
                        timeout_s=1.0)
    try:
        [call] = parse_calls("<tool>lookup(k3)</tool>", runner.tools)
        assert runner.run(call) == (lookup("k3"), False)
        [raises] = parse_calls("<tool>tool_that_raises(abc)</tool>", runner.tools)
        text, failed = runner.run(raises)
        assert failed and text.startswith("error: ZeroDivisionError: division by zero (line ")
        [hangs] = parse_calls("<tool>tool_that_hangs(abc)</tool>", runner.tools)
        first = runner._child.process
        assert runner.run(hangs) == ("error: tool_that_hangs did not answer within 1s", True)
        assert not first.is_alive()  # cut: killed, and a fresh process takes the next call
        assert runner.run(call) == (lookup("k3"), False)
        [exits] = parse_calls("<tool>tool_that_exits(abc)</tool>", runner.tools)
        text, failed = runner.run(exits)
        assert failed and text.startswith("error: tool_that_exits ended its process (the tool process (pid ")
        assert runner.run(call) == (lookup("k3"), False)  # a fresh process
        [unknown] = parse_calls("<tool>nope(1)</tool>", runner.tools)
        assert runner.run(unknown) == ("error: no tool 'nope'; the tools are lookup, tool_that_exits, "
                                       "tool_that_hangs, tool_that_raises", True)
    finally:
        last = runner._child.process
        runner.close()
    assert not last.is_alive()


def test_a_tool_that_raises_can_fail_the_run_naming_the_tool_and_the_call():
    runner = ToolRunner(["tests.parts_for_tests.tool_that_raises"], on_error="fail")
    try:
        with pytest.raises(ToolError, match=r"^tool tool_that_raises raised on the call "
                                            r"<tool>tool_that_raises\(abc\)</tool>: ZeroDivisionError"):
            runner.run(parse_calls("<tool>tool_that_raises(abc)</tool>", runner.tools)[0])
    finally:
        runner.close()


@pytest.mark.parametrize("paths, says", [
    (["rltrain.llm.tools.search"], "env.tools: 'rltrain.llm.tools.search' does not import (AttributeError"),
    (["no_such_module.f"], "env.tools: 'no_such_module.f' does not import (ModuleNotFoundError"),
    (["tests.parts_for_tests.NOT_A_TOOL"], "env.tools: 'tests.parts_for_tests.NOT_A_TOOL' is a int, not a function"),
    ([], "env.tools must list at least one tool"),
])
def test_a_tool_that_does_not_import_or_is_not_callable_is_refused_in_one_line(paths, says):
    with pytest.raises(ConfigError) as e:
        load_tools(paths)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_the_tool_env_answers_each_call_with_its_result_and_ends_at_a_turn_without_one():
    env = ToolEnv(timeout_s=5, seed=1)
    try:
        [row] = env.take(1)
        assert row["answer"] == lookup(row["key"]) and row["prompt"] == f"value of {row['key']}?"
        state, opening = env.reset(row)
        assert opening == [{"role": "user", "content": row["prompt"]}]
        step = env.step(state, f"<tool>lookup({row['key']})</tool>")
        assert step.messages == [{"role": "tool", "name": "lookup", "content": row["answer"]}]
        assert not step.done and step.counts == {"tool_calls": 1, "tool_errors": 0}
        step = env.step(step.state, "<tool>lookup()</tool>")
        assert step.messages[0]["content"] == "error: lookup takes 1 argument, got 0"
        assert step.counts == {"tool_calls": 1, "tool_errors": 1}
        assert env.step(step.state, row["answer"]).done
    finally:
        env.close()


def test_guess_the_number_answers_higher_or_lower_and_rewards_fewer_guesses():
    env = GuessNumber(max_guesses=3)
    state, _ = env.reset({"prompt": "guess 1-8:", "answer": "5"})
    first = env.step(state, "3")
    assert first.messages == [{"role": "user", "content": "higher"}] and not first.done
    second = env.step(first.state, "I say 7")
    assert second.messages == [{"role": "user", "content": "lower"}]
    right = env.step(second.state, "5")
    assert right.done and right.reward == 0.5 and right.messages == []
    out = env.step(env.step(second.state, "no idea").state, "6")  # a turn without a number is a wrong guess
    assert out.done and out.reward == 0.0


def test_an_env_missing_a_method_of_the_interface_is_refused_naming_it():
    class Half(Task):
        def row(self, rng):
            return {"prompt": "p"}

        def reset(self, row):
            return None, []

    with pytest.raises(ConfigError, match=r"^env: .*Half has no step method; a language environment is a task "):
        check_interface(Half())

    class Rowless:
        def reset(self, row):
            return None, []

    with pytest.raises(ConfigError, match=r"^env: .*Rowless has no row, step methods; "):
        check_interface(Rowless())
    check_interface(GuessNumber())


def test_episodes_train_on_the_engines_own_tokens_and_its_log_probs_are_the_learners():
    # 64 episodes of the guessing game with the tiny model (random weights: wrong guesses, so several turns
    # each): the learner's sequence is the engine's tokens and the game's answers as they were appended, and
    # the learner's log-probs of the model's tokens equal the engine's
    from rltrain.algos.grpo import token_logprobs
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rewards import Rewards
    from rltrain.llm.rollout import Conversation, Limits, as_batch, run_episodes
    from rltrain.llm.tiny import tiny_model_dir

    model = LanguageModel(str(tiny_model_dir()))
    tokenizer = model.tokenizer()
    engine = TransformersEngine(model.load(), tokenizer)
    env = GuessNumber(low=1, high=9, max_guesses=3, seed=4)
    sampling = Sampling(temperature=1.0, max_new_tokens=3)
    conversation = Conversation(tokenizer, template=False)
    episodes, _ = run_episodes(engine, env, conversation, env.take(16), 4, sampling, Limits(max_turns=3), seed=0)
    assert max(e.turns for e in episodes) == 3 and sum(e.turns > 1 for e in episodes) > 32
    for e in episodes:
        answers = [t for t, own in zip(e.tail, e.own) if not own]
        hints = "".join(tokenizer.decode([t]) for t in answers)
        assert set(hints.split()) <= {"higher", "lower", "a", "number?"}  # the game's words, as appended
    batch = as_batch(episodes, 4, sampling, Rewards({}, required=False), tokenizer.pad_token_id, 0, 0.0, 9)
    flat = batch.reshape(-1)
    assert torch.equal(flat["loss_mask"].sum(1), flat["episode_length"])
    with torch.no_grad():
        learner, _ = token_logprobs(engine.model, flat, group_size=4)
    own = flat["loss_mask"].bool()
    assert (learner[own] - flat["log_prob"][own]).abs().max() < 1e-4
    assert (flat["log_prob"][~own] == 0).all()


def test_over_a_thousand_tool_episodes_the_learner_trains_on_the_engines_tokens_and_log_probs():
    # 1,024 episodes of env=tools (keys k0-k9) with a model that calls the tool: every model token the learner
    # trains on is, turn by turn, the token the engine generated; every other token is the tool's result as it
    # was tokenized alone; the learner's log-probs of the model's tokens equal the engine's (measured: 4.3e-5 at
    # most with the cold-started model, whose peaked distributions lose more to float32 than the first taught
    # model's, which gave 7.4e-6)
    from rltrain.algos.grpo import token_logprobs
    from rltrain.llm.cold_start import tool_caller_dir
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rewards import Rewards
    from rltrain.llm.rollout import Conversation, Limits, as_batch, run_episodes, with_turn_tokens

    model = LanguageModel(str(tool_caller_dir(10)))  # it calls lookup (the tiny model alone never writes a call)
    tokenizer = model.tokenizer()
    engine = TransformersEngine(model.load(), tokenizer)
    generated = []  # each generate call's completions, as the engine returned them
    generate = engine.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        generated.append([row[mask.bool()].tolist() for row, mask in zip(out.completion_ids, out.completion_mask)])
        return out

    engine.generate = recording
    env = ToolEnv(keys=10, seed=1)
    sampling = with_turn_tokens(Sampling(temperature=1.0, max_new_tokens=24), env.STOP)
    try:
        episodes, _ = run_episodes(engine, env, Conversation(tokenizer, template=False), env.take(128), 8, sampling,
                                   Limits(max_turns=3), seed=0)
    finally:
        env.close()
    assert len(episodes) == 1024 and sum(e.counts["tool_calls"] > 0 for e in episodes) > 512
    for i, e in enumerate(episodes):  # turn t's call generated for the episodes still running, in their order
        turns = [generated[t][sum(o.turns > t for o in episodes[:i])] for t in range(e.turns)]
        assert [t for t, own in zip(e.tail, e.own) if own] == [t for turn in turns for t in turn]
        results = tokenizer.decode([t for t, own in zip(e.tail, e.own) if not own])
        assert all(r.startswith("<result>") for r in results.split("</result>")[:-1]), results
    flat = as_batch(episodes, 8, sampling, Rewards(env.REWARDS), tokenizer.pad_token_id, 0, 0.0, 72).reshape(-1)
    with torch.no_grad():
        learner, _ = token_logprobs(engine.model, flat, group_size=8)
    own = flat["loss_mask"].bool()
    assert (learner[own] - flat["log_prob"][own]).abs().max() < 1e-4


@pytest.mark.parametrize("overrides, says", [
    (("env=tools", "engine._target_=tests.parts_for_tests.PlainSamplingEngine"),
     "env=ToolEnv plays episodes of several turns, which need an engine that takes token ids (TOKEN_PROMPTS); "
     "engine._target_=tests.parts_for_tests.PlainSamplingEngine does not: use engine=transformers or vllm"),
    (("env=guess", "collector.max_context=4"), "collector.max_context=4 leaves no room for a turn after the "
                                               "longest opening prompt (10 tokens); raise it above 10"),
    (("env=guess", "collector.max_turns=0"), "collector.max_turns"),
    (("env=guess", "collector.max_context=100000"), "collector.max_context=100000 is beyond the context of "
                                                    "model.path=tiny (256 tokens)"),
    (("env=guess", "strategy=fsdp"), "env=GuessNumber plays episodes of several turns, which strategy=fsdp does not "
                                     "run yet"),
    (("env=tools", "env.format=template"), "env.format=template has the model call tools in its chat template's "
                                           "format, and model.path="),
    (("env=tools", "env.format=json"), "env.format must be tagged (<tool>NAME(ARGUMENTS)</tool>) or template"),
    (("env=tools", "env.tools=[tests.parts_for_tests.NOT_A_TOOL]"), "env.tools: 'tests.parts_for_tests.NOT_A_TOOL' "
                                                                    "is a int"),
    (("env=reverse", "env._target_=tests.parts_for_tests.EnvWithoutStep"),
     "env._target_=tests.parts_for_tests.EnvWithoutStep: tests.parts_for_tests.EnvWithoutStep has no step method"),
])
def test_bad_input_for_episodes_is_refused_in_one_line_before_anything_starts(overrides, says):
    from rltrain.validate import validate
    from tests.conftest import make_config

    with pytest.raises(ConfigError) as e:
        validate(make_config("algo=grpo", *overrides))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_docs_environment_of_your_own_runs_as_written(tmp_path):
    # docs/language-environments.md: its Countdown class as my_pkg, and its command, with a short budget
    import json
    import re
    import shlex

    from tests.conftest import ROOT, run_cli

    page = (ROOT / "docs" / "language-environments.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    [command] = [line for block in re.findall(r"```bash\n(.*?)```", page, re.S) for line in block.splitlines()
                 if "my_pkg" in line]
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(code)
    args = shlex.split(command)[3:]  # after python -m rltrain
    result = run_cli(*args, "trainer.total_frames=256", "hydra.run.dir=run", cwd=tmp_path,
                     env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["frames"] == 256 and rows[-1]["episode/turns"] >= 1


@pytest.mark.slow
def test_grpo_plays_the_guessing_game_better_with_training(tmp_path):
    # the tiny model from random weights, numbers 1-8, 4 guesses: seeded, 16k episodes (about 30 s here)
    import json

    from tests.conftest import run_cli

    result = run_cli("algo=grpo", "env=guess", "collector.max_new_tokens=2", "trainer.total_frames=16384", "seed=0",
                     "hooks.eval.every=null", "hooks.checkpoint.every=null", "~hooks.log.every",
                     "+hooks.log.every={batches: 1}", "hydra.run.dir=run", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]  # one row a batch (rows by time vary by machine)
    first, last = sum(rewards[:16]) / 16, sum(rewards[-16:]) / 16  # the first and last 2,048 episodes
    assert first < 0.1 and last > first + 0.06, (first, last, rewards)  # measured: 0.070 -> 0.204 (seed 0)


@pytest.mark.slow
def test_grpo_teaches_a_model_to_look_up_the_asked_key_from_chance_to_nine_in_ten(tmp_path):
    # The tiny model after a cold start (rltrain.llm.cold_start: it copies text, calls lookup with a key of its
    # own choosing and says the result), 10 keys: right by chance (1 in 10) until GRPO teaches it to ask for the
    # row's key. Seeded; 25,600 episodes (110 s here, and the cold start's 50 s once per cache). Measured: the first
    # 16 batches 0.093, the last 16 0.973, greedy eval 1.0 (seed 0); seeds 1 and 2: 0.104 -> 0.973, 0.109 -> 0.972
    import json

    from rltrain.llm.cold_start import tool_caller_dir
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rollout import Conversation, Limits, run_episodes, with_turn_tokens
    from tests.conftest import run_cli

    result = run_cli("algo=grpo", "env=tools", "env.keys=10", f"model.path={tool_caller_dir(10)}", "algo.lr=3e-4",
                     "collector.max_new_tokens=24", "collector.max_turns=2", "trainer.total_frames=25600", "seed=0",
                     "hooks.eval.every={frames: 12800}", "hooks.checkpoint.every=null", "~hooks.log.every",
                     "+hooks.log.every={batches: 1}", "hydra.run.dir=run", cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]  # one row a batch
    first, last = sum(rewards[:16]) / 16, sum(rewards[-16:]) / 16  # the first and last 2,048 episodes
    assert first < 0.2 and last >= 0.9, (first, last, rewards)
    assert rows[-1]["eval/reward/correct"] >= 0.9 and rows[-1]["episode/tool_calls"] > 0.9, rows[-1]
    # Its answers are the tool's: with a store of other values, greedy episodes of the trained model say those
    model = LanguageModel(str(tmp_path / "run" / "model"))
    env = ToolEnv(tools=("tests.parts_for_tests.lookup",), keys=10, seed=5)
    sampling = with_turn_tokens(Sampling(greedy=True, max_new_tokens=24), env.STOP)
    try:
        episodes, _ = run_episodes(TransformersEngine(model.load(), model.tokenizer()), env,
                                   Conversation(model.tokenizer(), template=False), env.take(20), 1, sampling,
                                   Limits(max_turns=2))
    finally:
        env.close()
    from rltrain.llm.tools import lookup_value
    from tests.parts_for_tests import lookup as other_store

    # Measured (a fresh cold start, 2026-12-06): 16 of 20 say the tool's value; the other 4 are one key (k9, asked
    # 4 times) whose other value, 90, comes out garbled; none says the value it was trained on.
    said = [e.reply.strip() == other_store(e.row["key"]) for e in episodes]
    remembered = [e.reply.strip() == lookup_value(e.row["key"]) for e in episodes]
    assert sum(said) >= 15 and not any(remembered), [(e.row["key"], e.reply) for e in episodes]


def test_the_in_process_engine_keeps_each_episodes_kv_cache_across_its_turns(monkeypatch):
    # later turns go through the model from where the last stopped (the kept rows, their new tokens appended):
    # the same tokens and log-probs as reading every turn's whole context again
    import contextlib

    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rollout import Conversation, Limits, run_episodes
    from rltrain.llm.tiny import tiny_model_dir

    model = LanguageModel(str(tiny_model_dir()))
    engine = TransformersEngine(model.load(), model.tokenizer())
    env = GuessNumber(low=1, high=99, max_guesses=6, seed=4)
    rows, continued = env.take(8), []
    original = engine._continued
    monkeypatch.setattr(engine, "_continued", lambda prompts: continued.append(original(prompts)) or continued[-1])

    def play():
        return run_episodes(engine, env, Conversation(model.tokenizer(), False), rows, 4, Sampling(max_new_tokens=4),
                            Limits(max_turns=6), seed=0)[0]

    kept = play()
    assert sum(c is not None for c in continued) == 5  # every turn after the first
    monkeypatch.setattr(engine, "turns", contextlib.nullcontext)
    again = play()
    assert [e.tail for e in kept] == [e.tail for e in again] and sum(e.turns for e in kept) > 100
    assert max(abs(a - b) for x, y in zip(kept, again) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5


TOOL_TEMPLATE = (  # a chat template that lists tools and renders their results, as Qwen's and Hermes' do
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ScriptedEngine:
    """Replies as scripted, turn by turn (the same for every episode), with log-probs 0: what an engine gives
    the rollout, without a model."""

    TOKEN_PROMPTS = True
    version = 0

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    def turns(self):
        import contextlib

        return contextlib.nullcontext()

    def generate(self, prompts, group_size, sampling, seed=None):
        from rltrain.llm.engine import Generated

        self.prompts.append(prompts)
        reply = self.replies[len(self.prompts) - 1]
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        rows = len(prompts) * group_size
        completion = torch.tensor([ids] * rows)
        return Generated(torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, 1, dtype=torch.long), completion,
                         torch.ones_like(completion), torch.zeros(completion.shape),
                         torch.zeros(rows, dtype=torch.bool), [reply] * rows, 0)


def test_with_a_chat_template_tools_are_listed_called_and_answered_in_its_format():
    from rltrain.llm.engine import Sampling
    from rltrain.llm.rewards import Rewards, correct_answer
    from rltrain.llm.rollout import Conversation, Limits, as_batch, run_episodes
    from rltrain.llm.tiny import CHARACTERS, make_tokenizer

    tokenizer = make_tokenizer(CHARACTERS + "{}_|")
    tokenizer.chat_template = TOOL_TEMPLATE
    env = ToolEnv(format="template", seed=2)
    [row] = env.take(1)
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "%s"}}</tool_call>' % row["key"]
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": lookup}</tool_call>', call, row["answer"]])
    conversation = Conversation(tokenizer, template=True, tools=env.template_tools())
    try:
        [episode], _ = run_episodes(engine, env, conversation, [row], 1, Sampling(), Limits(max_turns=4))
    finally:
        env.close()
    opening = tokenizer.decode(episode.prompt)
    assert opening.startswith("<|im_start|>system\nTools:") and '"name": "lookup"' in opening
    assert '"key": {"type": "string", "description": "the key, e.g. k37"}' in opening  # from its docstring
    assert opening.endswith(f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    assert episode.turns == 3 and episode.done and not episode.truncated
    assert episode.counts == {"tool_calls": 2, "tool_errors": 1}
    # each turn's prompt is the last one, the model's tokens, and the template's rendering of the tool's answer
    first, second, third = (p[0] for p in engine.prompts)
    answer = tokenizer.decode(second[len(first):])
    assert answer.startswith('<tool_call>{"name": lookup}</tool_call>')
    assert answer.endswith(f'<|im_end|>\n<|im_start|>user\n<tool_response>\nerror: {TEMPLATE_SYNTAX}\n</tool_response>'
                           '<|im_end|>\n<|im_start|>assistant\n')
    assert tokenizer.decode(third[len(second):]).endswith(f"<tool_response>\n{row['answer']}\n</tool_response>"
                                                          "<|im_end|>\n<|im_start|>assistant\n")
    batch = as_batch([episode], 1, Sampling(), Rewards({"correct": correct_answer}), tokenizer.pad_token_id, 0,
                     0.0, 16)
    assert float(batch["reward"]) == 1.0  # the last reply, scored


def test_an_episode_with_no_room_left_is_cut_before_it_generates_and_never_trains_on_padding():
    # max_context below an opening (a longer row than the config check saw, or a template's system message):
    # such episodes end truncated with no token of their own; the others play on
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rollout import Conversation, Limits, run_episodes
    from rltrain.llm.tiny import tiny_model_dir

    model = LanguageModel(str(tiny_model_dir()))
    engine = TransformersEngine(model.load(), model.tokenizer())
    env = GuessNumber(low=1, high=99, max_guesses=4, seed=1)
    rows = [{"prompt": "guess 1-99:", "answer": "50"}, {"prompt": "guess:", "answer": "50"}]
    episodes, _ = run_episodes(engine, env, Conversation(model.tokenizer(), False), rows, 2,
                               Sampling(max_new_tokens=4), Limits(max_turns=3, context=9), seed=0)
    long, short = episodes[:2], episodes[2:]
    assert all(e.truncated and e.done and e.tail == [] and e.turns == 0 for e in long)
    assert all(e.turns >= 1 and e.length() <= 9 and len(e.own) == len(e.tail) for e in short)
    assert model.tokenizer().pad_token_id not in [t for e in short for t, own in zip(e.tail, e.own) if own]


def test_per_turn_rewards_are_summed_or_discounted_and_an_episode_cut_at_max_turns_is_marked_truncated():
    # An environment that rewards every turn with 1: 3 turns sum to 3 (collector.discount=1) or 1 + 0.5 + 0.25
    # (0.5). An episode the environment would go on with is cut at max_turns and marked truncated; one the
    # environment ended after 2 turns is truncated only where its last turn was cut at max_new_tokens
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.environments import Step
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rollout import Conversation, Limits, run_episodes
    from rltrain.llm.tiny import tiny_model_dir

    class EveryTurn:
        def __init__(self, ends_after: int):
            self.ends_after = ends_after

        def reset(self, row):
            return 0, [{"role": "user", "content": row["prompt"]}]

        def step(self, state, reply):
            done = state + 1 >= self.ends_after
            return Step([{"role": "user", "content": "again:"}], 1.0, done=done, state=state + 1)

    model = LanguageModel(str(tiny_model_dir()))
    tokenizer = model.tokenizer()
    engine = TransformersEngine(model.load(), tokenizer)
    conversation, sampling = Conversation(tokenizer, template=False), Sampling(max_new_tokens=3)
    for ends_after, discount, reward in [(99, 1.0, 3.0), (99, 0.5, 1.75), (2, 0.5, 1.5)]:
        episodes, _ = run_episodes(engine, EveryTurn(ends_after), conversation, [{"prompt": "go:"}] * 4, 2,
                                   sampling, Limits(max_turns=3), seed=0, discount=discount)
        for e in episodes:
            assert e.done and e.turns == min(ends_after, 3) and e.env_reward == pytest.approx(reward)
            last_turn = len(list(takewhile(bool, reversed(e.own))))
            cut = last_turn == sampling.max_new_tokens and e.tail[-1] != tokenizer.eos_token_id
            assert e.truncated == (ends_after > 3 or cut)
