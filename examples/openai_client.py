"""Chat and completions with the official OpenAI client, plain and streaming.

    python -m tinyserve                  # in another shell (serves the bundled stories260k)
    python examples/openai_client.py
"""

import os

from openai import OpenAI

url = os.environ.get("TINYSERVE_URL", "http://127.0.0.1:8000")  # where the server listens
client = OpenAI(base_url=url + "/v1", api_key="unused")
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16,
                                       temperature=0)
print("completion:", completion.choices[0].text)
print("usage:", completion.usage)

print("chat (streaming): ", end="", flush=True)
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story about a cat."}],
    max_tokens=24, temperature=0.8, seed=1, stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
