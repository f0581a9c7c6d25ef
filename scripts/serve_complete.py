"""A harness on an OpenAI-compatible server: answers questions of a JSONL file through /v1/chat/completions and
writes the completions file that ``grpax evaluate completions_path=`` scores.

Each question is rendered as train_rl renders it with ``--prompt_preset`` (system prompt, user template; the
preset's response prefix as the start of the assistant turn, continued with vLLM's ``continue_final_message``),
so a checkpoint trained with a preset is asked as it was trained. Works against ``grpax serve`` and vLLM alike.
Each output line holds the input line's fields (``question``, ``answer``...) plus ``completion``,
``response_prefix``, and, from servers that return them (``return_token_ids``), ``prompt_token_ids``,
``token_ids``, ``logprobs`` and ``policy_version``; a question's ``--n`` samples are on consecutive lines.

Usage:
  grpax serve load_parameters_path=outputs/smollm2/0/items &
  python scripts/serve_complete.py --base_url http://127.0.0.1:8000/v1 --model smollm2 \\
      --questions ../shared/data/gsm8k/test.jsonl --num_questions 64 --out completions.jsonl
  grpax evaluate completions_path=completions.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def messages_for(question: str, preset) -> tuple[list[dict], dict]:
    """The chat messages of ``question`` with ``preset`` and the request fields that continue its prefix."""
    from grpax.data.prompts import build_messages

    messages = build_messages(question, preset.system_prompt, preset.user_template)
    if not preset.response_prefix:
        return messages, {}
    messages.append({"role": "assistant", "content": preset.response_prefix})
    return messages, {"add_generation_prompt": False, "continue_final_message": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="the served model's id (GET /v1/models)")
    ap.add_argument("--api_key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    ap.add_argument("--questions", required=True, type=Path, help="JSONL with a 'question' field per line")
    ap.add_argument("--num_questions", type=int, default=-1, help="the first N lines (-1: all)")
    ap.add_argument(
        "--prompt_preset", default="smollm2_demo", help="grpax prompt preset ('plain': the question)"
    )
    ap.add_argument("--n", type=int, default=1, help="samples per question (evaluate's num_eval_passes)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max_tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)

    import openai

    from grpax.tasks.prompts import get_prompt_preset

    preset = get_prompt_preset(args.prompt_preset)
    with args.questions.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if args.num_questions >= 0:
        rows = rows[: args.num_questions]
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2, timeout=3600)

    def ask(row: dict) -> list[dict]:
        messages, extra = messages_for(row["question"], preset)
        r = client.chat.completions.create(
            model=args.model,
            messages=messages,
            n=args.n,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
            logprobs=True,
            extra_body={"return_token_ids": True, **extra},
        )
        lines = []
        for choice in r.choices:
            line = {**row, "completion": choice.message.content, "response_prefix": preset.response_prefix}
            line["finish_reason"] = choice.finish_reason
            if getattr(r, "prompt_token_ids", None) is not None:
                line["prompt_token_ids"] = r.prompt_token_ids
                line["token_ids"] = choice.token_ids
            if choice.logprobs is not None and choice.logprobs.content is not None:
                line["logprobs"] = [e.logprob for e in choice.logprobs.content]
            if getattr(r, "policy_version", None) is not None:
                line["policy_version"] = r.policy_version
            lines.append(line)
        return lines

    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(ask, rows))
    args.out.write_text("".join(json.dumps(line) + "\n" for lines in answers for line in lines))
    print(
        f"wrote {sum(map(len, answers))} completions of {len(rows)} questions to {args.out}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
