"""The repetition penalty end to end on stories260k: the prompt must reach the penalty.

vLLM's repetition penalty (like transformers') counts the prompt's tokens as well as the
output's; the kernel test builds the prompt ids itself, so only a run through the scheduler
shows that they are passed. Greedy output must equal a float32 torch reference over
transformers' logits that penalizes prompt and output, and that reference must differ from
the one that penalizes the output alone (what a lost prompt would give).
"""

import pytest
import torch

from tinyserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

# the first draw already differs: penalizing the output alone repeats " ball" (" b" "all"),
# counting the prompt too gives " to"
PROMPT = "Lily had a red ball. She liked the red"
PENALTY = 2.0
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf(stories_dir):
    return transformers.LlamaForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()


def penalized_greedy(hf, prompt: list[int], count_prompt: bool) -> list[int]:
    """Greedy tokens with vLLM's repetition penalty: a seen token's logit is divided by the
    penalty if positive, multiplied if not. Each draw's top two must be clearly apart, so a
    float32 rounding difference between the engine and transformers cannot swap them."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()  # [V]
            seen = torch.tensor(sorted(set((prompt if count_prompt else []) + out)),
                                dtype=torch.long)
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / PENALTY,
                                       logits[seen] * PENALTY)
            top2 = torch.topk(logits, 2).values
            assert top2[0] - top2[1] > 1e-3, "a near tie: pick another prompt"
            out.append(int(logits.argmax()))
    return out


def test_greedy_with_a_repetition_penalty_penalizes_the_prompt(stories_dir, hf):
    llm = LLM(str(stories_dir), dtype="float32")
    prompt = llm.tokenizer.encode(PROMPT)
    want = penalized_greedy(hf, prompt, count_prompt=True)
    assert want[0] != penalized_greedy(hf, prompt, count_prompt=False)[0]  # the test can tell
    assert hf.config.eos_token_id not in want
    # the reference agrees with transformers' own processor, which counts the prompt too
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             repetition_penalty=PENALTY)
    assert hf_out[0, len(prompt):].tolist() == want
    [out] = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                  repetition_penalty=PENALTY, ignore_eos=True))
    assert list(out.token_ids) == want
