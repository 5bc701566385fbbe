"""A small Qwen2 checkpoint with a locally trained byte-level BPE tokenizer and a ChatML template, for tests.

`CORPUS` is a fixed multi-line Unicode text in the style of the dataset domains (word problems with numeric
answers, multiple choice, several scripts and an emoji); `make_qwen2_bpe_dir` trains the tokenizer on it and
writes a random-init Qwen2 of a preset's size beside it (`alloy model init --arch qwen2 --tokenizer bpe`).
"""
from __future__ import annotations

from pathlib import Path

CORPUS = """\
Question: Anna has 12 apples and buys 30 more. How many apples does she have now?
Answer: 42
Question: A train travels 1,250 km in 5 hours. What is its average speed in km/h?
Answer: 250
Frage: Jürgen kauft 3 Brötchen für je 0,45 €. Wie viel bezahlt er?
Antwort: 1,35
Question : Élodie a 7 crayons ; elle en donne 2 à Zoé. Combien lui en reste-t-il ?
Réponse : 5
Pregunta: ¿Cuántos días tiene una semana? Señala la opción correcta.
A) 5
B) 7
C) 10
Respuesta: B
Вопрос: Сколько будет 6 × 7? Ответ: 42
Ερώτηση: Πόσο κάνει 3/4 + 1/4; Απάντηση: 1
問題：りんごが3個とみかんが4個あります。くだものは全部で何個ですか？
答え：7
问题：一个正方形的边长是5厘米，它的面积是多少平方厘米？
答案：25
Which planet is known as the Red Planet? 🪐
A) Venus
B) Mars
C) Jupiter
D) Saturn
Answer: B
def add(a, b):
    return a + b
Temperature: −3.5 °C → 25.7 °F; ratio ≈ 0.75; π ≈ 3.14159
Thanks! 🙂 ✓ Done.
"""


def make_qwen2_bpe_dir(out: Path, preset: str = "tiny", vocab_size: int = 512, seed: int = 0) -> Path:
    from infra.models import init_model_dir

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out.parent / f"{out.name}-corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    return init_model_dir(preset, out, seed=seed, arch="qwen2", tokenizer="bpe", train_text=[corpus],
                          vocab_size=vocab_size)
