"""Generation from a trained moejax model (docs/generation.md).

    from moejax.inference import load_model, generate
    lm = load_model("runs/tiny")
    out = generate(lm, [lm.tokenizer.encode("def fib(n):")], max_new_tokens=64)
    print(lm.tokenizer.decode(out.tokens[0]))
"""

from moejax.inference.conversation import Conversation, GenerateOutput, generate, stream
from moejax.inference.loading import LanguageModel, TextTokenizer, from_variables, load_model, random_model

__all__ = ["Conversation", "GenerateOutput", "LanguageModel", "TextTokenizer", "from_variables", "generate",
           "load_model", "random_model", "stream"]
