"""Chat with the served model through the official OpenAI client, streamed, keeping the turns.

    python -m tinyserve --model smollm2       # in another shell: a real chat model (fetched once)
    python examples/chat.py                   # then type; an empty line ends
    python examples/chat.py "What is the capital of France?"     # one question, one answer
    python examples/chat.py --max-tokens 16 "Hi"                 # shorter answers

On a CPU the kernels run in Triton's interpreter: SmolLM2-135M takes several seconds a token.
"""

import argparse
import os

from openai import OpenAI

ap = argparse.ArgumentParser(description="chat with the served model")
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("question", nargs="*", help="ask these and exit (default: read from the terminal)")
args = ap.parse_args()

url = os.environ.get("TINYSERVE_URL", "http://127.0.0.1:8000")  # where the server listens
client = OpenAI(base_url=url + "/v1", api_key="unused")
model = client.models.list().data[0].id
messages = []
questions = args.question or iter(lambda: input("you> "), "")
for question in questions:
    messages.append({"role": "user", "content": question})
    print(f"{model}> ", end="", flush=True)
    answer = ""
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=args.max_tokens,
                                            temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            answer += chunk.choices[0].delta.content
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    messages.append({"role": "assistant", "content": answer})
