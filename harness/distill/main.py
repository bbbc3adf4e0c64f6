"""Distil the embedded default draft for SmolLM2-135M-Instruct.

    python -m harness.distill --out harness/assets/smollm2_draft --layers 4 --head-tokens 8192 --seed 0

The draft (see harness.models.shared_draft) is a few Llama layers on top of the
target's own embedding table, with an LM head restricted to S tokens whose
rows are copies of the target's (tied) embedding rows. Only the layers and
the final norm are trained; the embedding and the head rows stay frozen, so
only the layers and the norm need storing.

Method, step by step:

1. Training prompts are generated here from templates and topic lists,
   covering the six kinds of task of the evaluation set (conversation,
   translation, summarization, qa, math, code) with different text. The
   evaluation prompts (harness/data/builtin_prompts.jsonl) are never used
   for training; a check refuses training prompts sharing a long word
   sequence with them. Prompts are formatted with the target's chat
   template, generation prompt included.
2. Data: continuations sampled from the target itself (batched
   `generate`, left padding; one per prompt at each of `--temperatures`,
   up to 128 new tokens each), so the draft learns the target's own text.
3. Teacher: one full forward of the target over each prompt+continuation;
   at every training position (from the first user-message token on: the
   fixed system preamble is skipped) its next-token distribution at
   temperature 1 is kept compactly as the top-k probabilities and ids in
   fp16/int32. Continuation positions have weight 1, prompt positions
   `--prompt-weight`.
4. Head subset: the S tokens with the most target probability mass over
   the training positions (summed over the stored top-k, weighted as in the
   loss), always including the chat special tokens and every whitespace
   token holding a newline.
5. Student: `--layers` layers initialised from target layers (default: the
   first half and the last half of the stack, e.g. 0, 1, 28, 29), trained
   with AdamW, warmup then cosine decay, on
       -sum_{v in S} p(v) log q(v)  +  top1_weight * -log q(argmax p)
   (forward KL to the teacher restricted to the head, plus a top-1 term
   that helps greedy agreement; the top-1 term is dropped where the
   teacher's argmax is outside S).
6. Held-out evaluation on target continuations of the 60 builtin prompts
   (greedy and sampled at T=1 with a fixed seed, 64 new tokens):
   (a) T=0 agreement: fraction of continuation positions where the draft's
       argmax equals the target's;
   (b) T=1: mean sum_v min(p(v), q(v)), the expected acceptance of one
       drafted token.
   The numbers are computed on the weights as stored (rounded to fp16).
7. The draft is saved with `save_shared_draft`, with the command line,
   arguments, data size, timings, evaluation and library versions in
   harness_draft.json.

Generated data (tokens and teacher top-k) is cached under
<cache>/specbench-harness/distill/, keyed by everything it depends on, so a
rerun skips generation. Everything is seeded: on the same machine, library
versions and thread count, the command reproduces the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from harness.models.shared_draft import build_shared_draft, save_shared_draft
from harness.models.embedded import cache_root, embedded_model_dir

SPECIAL_TOKENS = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
BUILTIN_PROMPTS = Path(__file__).parents[1] / "data" / "builtin_prompts.jsonl"
DATA_FORMAT = 1  # bump when the cached data layout or its generation changes


# ---------------------------------------------------------------------------
# Training prompts: templates x topics, distinct from the evaluation prompts.
# ---------------------------------------------------------------------------

ADVICE_GOALS = [
    "get better sleep when I work late shifts",
    "stay motivated while learning a new language on my own",
    "keep my houseplants alive when I travel a lot",
    "save money on groceries without eating the same meals every week",
    "prepare for my first half marathon in four months",
    "organize a small apartment that has almost no storage space",
    "become more confident when speaking in meetings",
    "start a vegetable garden on a balcony",
    "spend less time on my phone in the evenings",
    "plan a budget trip across Europe by train",
    "get along better with a coworker who often interrupts me",
    "teach my ten-year-old to manage pocket money",
    "get back into running after a knee injury",
    "keep in touch with friends who live in other countries",
    "cook healthy dinners when I only have twenty minutes",
    "adopt a rescue dog and help it settle into my home",
    "make my morning routine less rushed",
    "prepare for a long-haul flight with a toddler",
    "learn to play the piano as an adult beginner",
    "deal with stress during exam season",
    "host a dinner party for eight people on a small budget",
    "choose a first camera for landscape photography",
]
STORY_IDEAS = [
    "a baker who discovers that her bread makes people tell the truth",
    "a robot that wants to learn how to paint",
    "two strangers stuck in an elevator during a thunderstorm",
    "a girl who finds a map hidden inside an old library book",
    "a cat who secretly runs the post office in a small village",
    "an astronaut who hears music coming from the Moon",
    "a boy who trades his shadow for a bicycle",
    "a retired detective solving one last mystery at a summer fair",
    "a tree that remembers everyone who ever climbed it",
    "a street musician whose violin can change the weather",
    "a lost umbrella travelling around a big city",
    "a village where it snows only on birthdays",
]
MESSAGE_CASES = [
    ("a warm", "thank-you note", "my teacher", "for helping me prepare for my final exams"),
    ("a polite", "email", "my landlord", "asking him to fix the heating in my flat"),
    ("a short", "congratulations message", "my cousin", "who just graduated from nursing school"),
    ("a friendly", "invitation", "my colleagues", "to a picnic in the park next Saturday"),
    ("a sincere", "apology", "my best friend", "for forgetting her birthday"),
    ("a professional", "email", "a client", "to say that the project will be one week late"),
    ("a funny", "farewell message", "a coworker", "who is retiring after thirty years"),
    ("a kind", "get-well-soon card", "my neighbour", "who is recovering from surgery"),
    ("a brief", "welcome message", "new members", "of our book club"),
    ("an enthusiastic", "announcement", "the parents at my school", "about the upcoming science fair"),
    ("a gentle", "reminder", "my team", "to submit their timesheets by Friday"),
    ("a heartfelt", "toast", "my sister and her husband", "on their wedding day"),
]
POEM_SUBJECTS = [
    "the first morning of spring", "an old lighthouse at night", "a rainy afternoon in a café",
    "the ocean in winter", "a cat sleeping in the sun", "the last day of summer holidays",
    "city lights seen from a plane", "autumn leaves in a park", "a grandmother's kitchen",
    "a train crossing the mountains",
]
IDEA_REQUESTS = [
    ("five", "fun activities for a rainy day at home with children"),
    ("four", "themes for a small office party"),
    ("three", "easy weekend projects to make a garden more welcoming for birds"),
    ("five", "names for a cozy neighbourhood coffee shop"),
    ("four", "gift ideas for a friend who loves cooking"),
    ("three", "ways to celebrate a tenth wedding anniversary without spending much"),
    ("five", "hobbies that someone could start with almost no money"),
    ("four", "day trips for a family visiting the seaside"),
    ("three", "icebreaker games for a group of new students"),
    ("five", "healthy snacks to bring on a long hike"),
]

EN_SENTENCES = [
    "The bus to the airport leaves every thirty minutes from the main square.",
    "My grandmother grows tomatoes and herbs in her small garden.",
    "We should bring umbrellas because it might rain this afternoon.",
    "The concert was cancelled because the singer was ill.",
    "Can you recommend a good restaurant near the hotel?",
    "I have been learning to swim since last summer.",
    "The children are building a sandcastle on the beach.",
    "Please turn off the lights when you leave the room.",
    "Our train was delayed by almost an hour this morning.",
    "She reads the newspaper every morning with a cup of coffee.",
    "The museum has a new exhibition about ancient ships.",
    "I forgot my keys at the office, so I have to go back.",
    "How much does a ticket to the city centre cost?",
    "They are planning to move to a bigger apartment next year.",
    "The doctor told me to drink more water and rest.",
    "We watched the sunset from the top of the hill.",
]
FOREIGN_SENTENCES = [
    ("French", "Nous avons visité le château pendant les vacances d'été."),
    ("French", "Est-ce que tu peux m'aider à porter ces cartons ?"),
    ("French", "Le train pour Lyon part à huit heures et quart."),
    ("French", "Ma sœur apprend à jouer du violon depuis deux ans."),
    ("French", "Il fait très froid ce matin, prends ton écharpe."),
    ("French", "Nous allons au cinéma ce soir avec nos amis."),
    ("German", "Ich trinke jeden Morgen einen Kaffee, bevor ich zur Arbeit gehe."),
    ("German", "Das Restaurant an der Ecke hat sehr gutes Essen."),
    ("German", "Kannst du mir bitte sagen, wie spät es ist?"),
    ("German", "Im Sommer fahren wir oft an den See zum Schwimmen."),
    ("German", "Mein Bruder arbeitet in einer großen Bank in Frankfurt."),
    ("German", "Die Kinder spielen nach der Schule im Park Fußball."),
    ("Spanish", "Mañana vamos a la playa con toda la familia."),
    ("Spanish", "¿Dónde está la estación de autobuses más cercana?"),
    ("Spanish", "Mi abuelo cocina la mejor paella del pueblo."),
    ("Spanish", "Los domingos siempre desayunamos churros con chocolate."),
    ("Spanish", "Tengo que terminar este informe antes del viernes."),
    ("Spanish", "El perro de mis vecinos ladra toda la noche."),
    ("Italian", "La pizza di questo ristorante è davvero buonissima."),
    ("Italian", "Domani mattina andiamo al mercato a comprare la frutta."),
]
TARGET_LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese"]
TRANSLATE_TO_TEMPLATES = [
    'Translate the following sentence into {lang}: "{text}"',
    'How would you say this in {lang}? "{text}"',
    'Please translate this English text into {lang}: "{text}"',
    'Translate into {lang}, keeping the tone natural: "{text}"',
]
TRANSLATE_FROM_TEMPLATES = [
    'Translate this {src} sentence into English: "{text}"',
    'What does this {src} sentence mean in English? "{text}"',
    'Please translate the following {src} text into English: "{text}"',
]

PASSAGES = [
    ("article", "The first bicycles, built in the early nineteenth century, had no pedals: riders pushed "
     "themselves along with their feet. Pedals attached to the front wheel came decades later, followed by "
     "the tall penny-farthing, which was fast but dangerous. The so-called safety bicycle of the 1880s, with "
     "two wheels of equal size and a chain driving the rear wheel, finally made cycling practical for ordinary "
     "people. Within a few years, bicycles changed how people travelled to work and gave many women a new "
     "sense of independence."),
    ("news report", "The city council of Westford voted on Tuesday to add twelve kilometres of protected bike "
     "lanes over the next two years. Supporters said the lanes would make streets safer and reduce traffic, "
     "while some shop owners worried about losing parking spaces in front of their businesses. The council "
     "promised to study parking needs before construction begins and to hold public meetings in each "
     "neighbourhood. The first section, along River Road, is expected to open next spring."),
    ("story", "Every evening, Tomas practiced on the old violin he had found in his grandfather's attic. The "
     "strings were stiff and the sound was thin, and his sister laughed whenever he played. One day a woman "
     "from the music shop heard him through the open window and offered to repair the instrument for free. "
     "When Tomas played it again, the violin sounded warm and clear, and even his sister stopped to listen."),
    ("email", "Hello everyone, this is a reminder that our annual team retreat will take place on the 14th and "
     "15th of next month at the lakeside lodge. A bus will leave the office at 8 a.m. on the first day, so "
     "please arrive a little early. Meals and rooms are already booked, but let me know by Friday if you have "
     "any dietary needs. Bring comfortable shoes, since we are planning a short hike on the second afternoon."),
    ("product review", "I bought these wireless headphones for my daily commute, and overall I am happy with "
     "them. The sound is clear, the noise cancelling works well on the train, and the battery easily lasts a "
     "whole week. However, the ear cushions get warm after an hour, and the companion app is confusing to use. "
     "For the price they are a good choice, but people who wear headphones all day may want something lighter."),
    ("passage", "Monarch butterflies make one of the longest migrations of any insect. Each autumn, millions "
     "of them fly from Canada and the northern United States to the mountains of central Mexico, a journey "
     "of up to four thousand kilometres. No single butterfly makes the round trip: the return north in spring "
     "takes several generations. Scientists believe the butterflies use the position of the sun and an "
     "internal clock to find their way."),
    ("blog post", "Last year I decided to learn to bake bread, and my first loaves were flat and heavy. I "
     "learned that patience matters more than any special equipment: giving the dough enough time to rise "
     "made the biggest difference. I also started weighing ingredients instead of using cups, which made my "
     "results far more consistent. Now I bake twice a week, and my neighbours have started asking for lessons."),
    ("paragraph", "Solar panels turn sunlight into electricity using cells made mostly of silicon. When light "
     "hits a cell, it knocks electrons loose, and this flow of electrons is an electric current. The price of "
     "solar panels has fallen sharply over the past fifteen years, so many households now install them on their "
     "roofs. Because panels produce nothing at night, they are often combined with batteries or with the "
     "regular power grid."),
    ("news report", "A new exhibition at the Harbour Museum brings together more than two hundred objects "
     "recovered from shipwrecks along the coast. Visitors can see coins, navigation tools, and pieces of "
     "pottery that lay on the sea floor for centuries. The museum worked with local divers for three years to "
     "prepare the show. It opens on Friday and will run until the end of the year, with free entry on the "
     "first Sunday of each month."),
    ("text", "Composting is a simple way to reduce household waste. Fruit and vegetable scraps, coffee grounds, "
     "and dry leaves can be collected in a bin, where bacteria and worms slowly break them down. After a few "
     "months, the mixture becomes dark, crumbly soil that is rich in nutrients. Gardeners use compost to feed "
     "their plants, and cities that collect food waste can send much less rubbish to landfills."),
    ("memo", "Starting next Monday, all staff laptops will receive a security update that requires a restart. "
     "The update will be installed automatically between 6 and 7 p.m., so please save your work before leaving "
     "for the day. If your laptop is switched off, the update will run the next time you log in, which may take "
     "up to fifteen minutes. Contact the help desk if you notice any problems afterwards."),
    ("article", "Emperor penguins live on the sea ice around Antarctica and breed during the coldest months "
     "of the year. After the female lays a single egg, she passes it to the male and returns to the sea to "
     "feed. The males huddle together in large groups for about two months, keeping the eggs warm on their "
     "feet while eating nothing at all. When the chicks hatch, the females come back and the parents take "
     "turns caring for them."),
    ("story", "Lina had never been good at chess, but when her school started a club she joined anyway. For "
     "weeks she lost every game, and she wrote down each mistake in a small notebook. Slowly, the notebook "
     "became thinner as she stopped repeating the same errors. At the end of the year she won her first "
     "tournament game, against the boy who had beaten her on the very first day."),
    ("passage", "The Great Wall of China is not a single wall but a series of walls built over many centuries. "
     "Early sections were made of packed earth, while the most famous parts, built during the Ming dynasty, "
     "used bricks and stone. The walls protected northern borders, allowed soldiers to send signals with "
     "smoke and fire, and helped control trade. Today large sections are in ruins, but others are popular "
     "places for visitors to walk."),
]
SUMMARY_FORMS = ["in one sentence", "in two sentences", "in three bullet points", "in about thirty words"]

QUESTIONS = [
    "How do airplanes stay in the air? Explain it in simple terms.",
    "Why do leaves change colour in autumn?",
    "What is the difference between weather and climate?",
    "How does the human heart pump blood around the body?",
    "Why does the Moon have phases? Explain briefly.",
    "What were the main causes of the First World War?",
    "How do bees make honey?",
    "What is the tallest mountain in the world, and where is it located?",
    "Why is the ocean salty?",
    "Who invented the telephone, and how did it change communication?",
    "What is inflation, and why do prices rise over time?",
    "How does a rainbow form?",
    "What is the largest desert in the world? Is it the Sahara?",
    "Why do cats purr?",
    "How do earthquakes happen?",
    "What is DNA, and why is it important?",
    "Who was Leonardo da Vinci, and what is he famous for?",
    "What causes thunder and lightning during a storm?",
    "How does the internet send information from one computer to another?",
    "Why do we need to sleep? Give a short answer.",
    "What is the difference between a virus and a bacterium?",
    "How did the ancient Egyptians build the pyramids?",
    "What is the water cycle? Describe its main stages.",
    "Why are some animals nocturnal?",
    "What is the capital of Canada, and why is it not Toronto?",
    "How does a refrigerator keep food cold?",
    "What was the Renaissance, and where did it begin?",
    "Why do objects float or sink in water?",
    "How do birds know where to fly when they migrate?",
    "What is gravity, and who first described it mathematically?",
    "Which planet in our solar system is the hottest, and why?",
    "What is the Amazon rainforest, and why is it important for the planet?",
    "How do electric cars work compared with petrol cars?",
    "Why do we get fevers when we are sick?",
    "What is the Great Barrier Reef, and where is it?",
    "Who was Nelson Mandela, and why is he remembered?",
    "How does a compass work?",
    "What is the difference between a star and a planet?",
    "Why do some people need glasses to see clearly?",
    "What was the Industrial Revolution, and how did it change daily life?",
    "How are mountains formed?",
    "Why is exercise good for the brain?",
    "What is the speed of light, and why is it important in physics?",
    "How did the printing of money begin in history? Answer briefly.",
    "What is the function of the lungs in the human body?",
    "Why do onions make people cry?",
    "Who were the Vikings, and where did they travel?",
    "How do plants know which way to grow?",
    "What is the difference between an ocean and a sea?",
    "Why does ice float on water?",
    "What causes the tides in the ocean?",
    "How does recycling plastic actually work?",
    "What is the Milky Way?",
    "Why do camels have humps?",
    "What was the purpose of the Olympic Games in ancient Greece?",
    "How do noise-cancelling headphones work?",
]
QA_SUFFIXES = ["", " Keep it short.", " Answer in a few sentences.", " Please explain simply."]

MATH_SUFFIXES = ["Solve it step by step.", "Show your work.", "Explain your reasoning.",
                 "Work through the problem step by step.", "Show the steps of your solution."]


def math_problems(rng: random.Random) -> list[str]:
    people = [("Anna", "she"), ("Ben", "he"), ("Carlos", "he"), ("Dina", "she"), ("Eli", "he"), ("Fatima", "she"),
              ("George", "he"), ("Hana", "she"), ("Ivan", "he"), ("Julia", "she"), ("Kofi", "he"), ("Leo", "he")]
    problems = []

    def n(lo: int, hi: int) -> int:
        return rng.randint(lo, hi)

    for _ in range(6):
        a, b, c, d = n(2, 9), n(2, 6), n(3, 12), n(2, 5)
        name, pron = rng.choice(people)
        problems.append(f"{name} buys {a} notebooks that cost ${b} each and {c} pencils that cost "
                        f"${d / 4:.2f} each. How much does {pron} pay in total?")
    for _ in range(6):
        speed, hours = n(40, 95), n(2, 6)
        problems.append(f"A car travels at {speed} kilometres per hour for {hours} hours. How far does it go, "
                        f"and how long would the same trip take at {speed + 10} kilometres per hour?")
    for _ in range(6):
        total, frac_num, frac_den = n(3, 9) * 12, n(1, 3), 4
        problems.append(f"A box holds {total} apples. {frac_num}/{frac_den} of them are green and the rest are "
                        f"red. How many red apples are in the box?")
    for _ in range(6):
        length, width = n(5, 30), n(3, 20)
        problems.append(f"A room is {length} metres long and {width} metres wide. What is its area, and how "
                        f"many square tiles of 1 square metre are needed to cover the floor?")
    for _ in range(6):
        price, pct = n(20, 200), rng.choice([10, 15, 20, 30, 40, 50])
        problems.append(f"A jacket costs ${price}. During a sale the price is reduced by {pct}%. What is the "
                        f"new price?")
    for _ in range(6):
        start_h, start_m, dur_h, dur_m = n(6, 15), rng.choice([0, 10, 20, 30, 45]), n(1, 4), rng.choice([15, 25, 40, 55])
        problems.append(f"A movie starts at {start_h}:{start_m:02d} and lasts {dur_h} hours and {dur_m} minutes. "
                        f"At what time does it end?")
    for _ in range(6):
        per_day, total = n(4, 25), n(3, 15)
        name, pron = rng.choice(people)
        problems.append(f"{name} runs {per_day} kilometres every day. How many kilometres does "
                        f"{pron} run in {total} days, and in how many days would "
                        f"{pron} reach {per_day * total + per_day * 5} kilometres?")
    for _ in range(6):
        group, cost, extra = n(3, 8), n(20, 90), n(2, 6)
        problems.append(f"{group} friends rent a boat for ${cost} and buy snacks for ${extra}.50 in total. If "
                        f"they share the cost equally, how much does each person pay?")
    for _ in range(6):
        heads = n(10, 30)
        cats = n(1, heads - 1)
        legs = cats * 4 + (heads - cats) * 2
        problems.append(f"In a yard there are ducks and cats. Together they have {heads} heads and {legs} legs. "
                        f"How many ducks and how many cats are there?")
    for _ in range(6):
        have, goal, weekly = n(10, 60), n(100, 400), n(5, 25)
        name, pron = rng.choice(people)
        problems.append(f"{name} has ${have} and wants to buy a tablet that costs ${goal}. "
                        f"{pron.capitalize()} saves ${weekly} each week. How many weeks will it take?")
    for _ in range(6):
        a, b = n(12, 99), n(3, 9)
        problems.append(f"What is {a} multiplied by {b}, and what is the remainder when {a * b + n(1, b - 1)} is "
                        f"divided by {b}?")
    return [f"{p} {rng.choice(MATH_SUFFIXES)}" for p in problems]


CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a number is prime",
    "returns the largest and smallest values in a list",
    "removes duplicate items from a list while keeping their order",
    "counts the vowels in a string",
    "converts kilometres to miles",
    "returns the factorial of a number using a loop",
    "merges two sorted lists into one sorted list",
    "checks whether two words are anagrams of each other",
    "returns the n-th Fibonacci number",
    "finds the second largest number in a list",
    "capitalizes the first letter of every word in a string",
    "computes the average of a list of numbers, returning 0 for an empty list",
    "flattens a list of lists into a single list",
    "checks whether a year is a leap year",
    "sums the digits of a positive integer",
    "returns the most common element in a list",
    "converts a string of binary digits to an integer",
    "splits a list into chunks of a given size",
    "validates that a password has at least eight characters and one digit",
    "finds all even numbers in a list and returns their squares",
    "returns a dictionary mapping each character of a string to its count",
    "reads a CSV file and prints the sum of the second column",
    "computes the greatest common divisor of two numbers",
    "rotates a list by k positions to the right",
    "checks whether a string contains balanced parentheses",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a short example of how to call it.",
    "Write a simple Python function that {task}, and add a docstring.",
]
OTHER_LANGUAGE_TASKS = [
    "Write a JavaScript function that returns the sum of all numbers in an array.",
    "Write a SQL query that selects the names of all customers who live in Paris.",
    "Write a short Bash script that prints the names of all .txt files in the current folder.",
    "Write a JavaScript function that checks whether a string is empty or only spaces.",
    "Write a SQL query that counts how many orders each customer has placed.",
    "Write a C function that returns the maximum of three integers.",
]
CODE_SNIPPETS = [
    "total = 0\nfor i in range(1, 6):\n    total += i * i\nprint(total)",
    "names = [\"ana\", \"bo\", \"cleo\"]\nlengths = {n: len(n) for n in names}\nprint(lengths)",
    "def g(x):\n    return x if x < 10 else g(x // 10)\n\nprint(g(4721))",
    "s = \"hello world\"\nprint(s[::-1].title())",
    "values = [5, 2, 9, 1]\nvalues.sort(reverse=True)\nprint(values[:2])",
    "count = 0\nwhile count < 3:\n    print(\"step\", count)\n    count += 1",
    "pairs = list(zip([1, 2, 3], \"abc\"))\nprint(pairs)",
    "def add(a, b=10):\n    return a + b\n\nprint(add(5), add(5, 1))",
    "text = \"one two three two one\"\nprint(sorted(set(text.split())))",
    "matrix = [[1, 2], [3, 4]]\nprint([row[1] for row in matrix])",
    "nums = [4, 7, 10, 13]\nprint(sum(n for n in nums if n > 5))",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
]
SNIPPET_TEMPLATES = [
    "Explain what this Python code does and what it prints:\n\n```python\n{code}\n```",
    "What is the output of the following Python code? Explain why.\n\n```python\n{code}\n```",
    "Walk me through this Python snippet line by line:\n\n```python\n{code}\n```",
]


def training_prompts(seed: int) -> list[tuple[str, str]]:
    """(category, prompt) pairs, deterministic in `seed`."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    # conversation
    for goal in ADVICE_GOALS:
        out.append(("conversation", rng.choice([
            f"Can you give me some practical advice on how to {goal}?",
            f"I would like to {goal}. What steps would you suggest?",
            f"What are some tips to {goal}?",
        ])))
    for idea in STORY_IDEAS:
        out.append(("conversation", f"Write a short story, about {rng.choice([100, 120, 150, 200])} words, about {idea}."))
    for tone, kind, who, why in MESSAGE_CASES:
        out.append(("conversation", f"Write {tone} {kind} to {who} {why}."))
    for subject in POEM_SUBJECTS:
        out.append(("conversation", f"Write a short poem about {subject}."))
    for count, what in IDEA_REQUESTS:
        out.append(("conversation", f"Suggest {count} {what}, with one sentence about each."))
    # translation
    for i, sentence in enumerate(EN_SENTENCES):
        for lang in rng.sample(TARGET_LANGUAGES, 3):
            out.append(("translation", rng.choice(TRANSLATE_TO_TEMPLATES).format(lang=lang, text=sentence)))
    for src, sentence in FOREIGN_SENTENCES:
        for template in rng.sample(TRANSLATE_FROM_TEMPLATES, 2):
            out.append(("translation", template.format(src=src, text=sentence)))
    # summarization
    for kind, passage in PASSAGES:
        for form in rng.sample(SUMMARY_FORMS, 3):
            out.append(("summarization", f"Summarize the following {kind} {form}:\n\n{passage}"))
    # qa
    for question in QUESTIONS:
        out.append(("qa", question + rng.choice(QA_SUFFIXES)))
    # math
    out.extend(("math", p) for p in math_problems(rng))
    # code
    for task in CODE_TASKS:
        for template in rng.sample(CODE_TEMPLATES, 2):
            out.append(("code", template.format(task=task)))
    out.extend(("code", t) for t in OTHER_LANGUAGE_TASKS)
    for code in CODE_SNIPPETS:
        out.append(("code", rng.choice(SNIPPET_TEMPLATES).format(code=code)))
    return out


def load_eval_prompts() -> list[dict]:
    return [json.loads(line) for line in BUILTIN_PROMPTS.read_text().splitlines() if line.strip()]


def check_disjoint(train: list[tuple[str, str]], evaluation: list[dict], ngram: int = 10) -> None:
    """Refuse training prompts sharing a run of `ngram` words with an evaluation prompt."""

    def shingles(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i:i + ngram]) for i in range(len(words) - ngram + 1)}

    eval_shingles = set().union(*(shingles(e["prompt"]) for e in evaluation))
    for _, prompt in train:
        common = shingles(prompt) & eval_shingles
        if common:
            raise SystemExit(f"training prompt overlaps the evaluation set ({' '.join(next(iter(common)))}): {prompt!r}")


# ---------------------------------------------------------------------------
# Data: target continuations and the teacher's top-k distributions.
# ---------------------------------------------------------------------------

def encode_prompts(tok, prompts: list[str]) -> list[list[int]]:
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@torch.inference_mode()
def generate(model, prompt_ids: list[list[int]], temperature: float, max_new: int, batch_size: int,
             seed: int, eos: int, log_every: int = 1, partial_dir: Path | None = None) -> list[list[int]]:
    """Continuations (each cut after the first EOS, which is kept) of every prompt.

    Prompts are batched by length (left padding, attention mask); the batch b
    is sampled after torch.manual_seed(seed + b), so the result depends only
    on the prompts, the seed and the batch size. With `partial_dir`, every
    batch is saved there as it is done, and an interrupted run resumes.
    """
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    out: list[list[int] | None] = [None] * len(prompt_ids)
    started, produced = time.time(), 0
    for b, first in enumerate(range(0, len(order), batch_size)):
        idx = order[first:first + batch_size]
        part = partial_dir / f"T{temperature}-seed{seed}-b{b}.pt" if partial_dir else None
        if part is not None and part.exists():
            for i, cont in zip(idx, torch.load(part)):
                out[i] = cont
                produced += len(cont)
            continue
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), eos, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            mask[row, width - len(prompt_ids[i]):] = 1
        torch.manual_seed(seed + b)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=eos,
                             eos_token_id=eos, **sampling)
        for row, i in enumerate(idx):
            cont = gen[row, width:].tolist()
            if eos in cont:
                cont = cont[:cont.index(eos) + 1]
            out[i] = cont
            produced += len(cont)
        if part is not None:
            part.parent.mkdir(parents=True, exist_ok=True)
            torch.save([out[i] for i in idx], part.with_suffix(".tmp"))
            part.with_suffix(".tmp").rename(part)
        if log_every and (b + 1) % log_every == 0:
            print(f"  generate T={temperature}: {first + len(idx)}/{len(order)} prompts, {produced} tokens, "
                  f"{time.time() - started:.0f}s", flush=True)
    return out  # type: ignore[return-value]


def batches_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.inference_mode()
def teacher_topk(model, seqs: list[list[int]], starts: list[int], k: int, batch_size: int, pad: int):
    """Per sequence: top-k probabilities [n, k] (fp16) and ids [n, k] (int32) of the target's
    next-token distribution (temperature 1) at positions starts[i] .. len-2."""
    probs_out: list[torch.Tensor | None] = [None] * len(seqs)
    ids_out: list[torch.Tensor | None] = [None] * len(seqs)
    started = time.time()
    for bi, idx in enumerate(batches_by_length([len(s) for s in seqs], batch_size)):
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
        logits = model(input_ids=ids, use_cache=False).logits  # right padding: causal, no mask needed
        for row, i in enumerate(idx):
            top = logits[row, starts[i]:len(seqs[i]) - 1].float().softmax(-1).topk(k, dim=-1)
            probs_out[i] = top.values.half()
            ids_out[i] = top.indices.int()
        if (bi + 1) % 20 == 0:
            print(f"  teacher: batch {bi + 1}, {time.time() - started:.0f}s", flush=True)
    return probs_out, ids_out


def position_weights(prompt_len: int, start: int, seq_len: int, prompt_weight: float) -> torch.Tensor:
    """Weights of positions start .. seq_len-2: a position predicting a prompt token gets prompt_weight."""
    pos = torch.arange(start, seq_len - 1)
    return torch.where(pos + 1 < prompt_len, prompt_weight, 1.0).float()


def data_key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def training_job(args, model, prompts: list[tuple[str, str]], prompt_ids: list[list[int]], common: int,
                 t_index: int, temperature: float, eos: int, model_dir: Path) -> dict:
    """One continuation of every prompt at `temperature`, with the teacher's top-k; cached on disk."""
    seed = args.seed * 1000 + t_index * 100_000
    payload = {
        "format": DATA_FORMAT, "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "temperature": temperature, "seed": seed, "max_new_tokens": args.max_new_tokens,
        "gen_batch_size": args.gen_batch_size, "teacher_batch_size": args.teacher_batch_size, "topk": args.topk,
        "prompt_weight": args.prompt_weight, "model": str(model_dir), "torch": str(torch.__version__),
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
    }
    path = cache_root() / "distill" / f"train-{data_key(payload)}.pt"
    if path.exists() and not args.no_cache:
        print(f"[distill] T={temperature}: cached {path}", flush=True)
        return torch.load(path)
    started = time.time()
    conts = generate(model, prompt_ids, temperature, args.max_new_tokens, args.gen_batch_size, seed, eos,
                     log_every=1, partial_dir=path.with_suffix(".partial"))
    gen_time = time.time() - started
    seqs = [p + c for p, c in zip(prompt_ids, conts)]
    prompt_lens = [len(p) for p in prompt_ids]
    starts = [common - 1] * len(seqs)
    weights = [position_weights(pl, st, len(s), args.prompt_weight) for pl, st, s in zip(prompt_lens, starts, seqs)]
    started = time.time()
    probs, ids = teacher_topk(model, seqs, starts, args.topk, args.teacher_batch_size, eos)
    job = {
        "payload": payload, "seqs": seqs, "prompt_lens": prompt_lens, "starts": starts, "weights": weights,
        "categories": [c for c, _ in prompts], "probs": probs, "ids": ids,
        "gen_time_s": gen_time, "teacher_time_s": time.time() - started,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(job, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    shutil.rmtree(path.with_suffix(".partial"), ignore_errors=True)
    return job


def build_training_data(args, model, tok, model_dir: Path) -> dict:
    """All training sequences (one per prompt and temperature), teacher top-k and token masses."""
    prompts = training_prompts(args.seed)
    check_disjoint(prompts, load_eval_prompts())
    if args.max_prompts:
        prompts = prompts[:: max(1, len(prompts) // args.max_prompts)][: args.max_prompts]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = encode_prompts(tok, [p for _, p in prompts])
    # Skip the fixed system preamble: losses start where the prompts start to differ.
    common = 0
    while all(len(p) > common + 1 for p in prompt_ids) and len({p[common] for p in prompt_ids}) == 1:
        common += 1
    jobs = [training_job(args, model, prompts, prompt_ids, common, t_index, temperature, eos, model_dir)
            for t_index, temperature in enumerate(args.temperatures)]
    data = {key: [x for job in jobs for x in job[key]]
            for key in ("seqs", "prompt_lens", "starts", "weights", "categories", "probs", "ids")}
    # Target probability mass per token over the training positions (from the top-k, loss-weighted).
    mass = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for p, i, w in zip(data["probs"], data["ids"], data["weights"]):
        mass.index_add_(0, i.flatten().long(), (p.double() * w.double()[:, None]).flatten())
    data.update(
        mass=mass, num_prompts=len(prompts),
        generated_tokens=sum(len(s) - pl for s, pl in zip(data["seqs"], data["prompt_lens"])),
        gen_time_s=sum(job["gen_time_s"] for job in jobs), teacher_time_s=sum(job["teacher_time_s"] for job in jobs),
    )
    return data


def build_eval_data(args, model, tok, model_dir: Path) -> dict:
    prompts = load_eval_prompts()
    if args.eval_prompts:
        prompts = prompts[:: max(1, len(prompts) // args.eval_prompts)][: args.eval_prompts]
    payload = {"format": DATA_FORMAT, "ids": [p["id"] for p in prompts], "seed": args.eval_seed,
               "new_tokens": args.eval_new_tokens, "batch": args.gen_batch_size, "model": str(model_dir),
               "torch": str(torch.__version__), "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    path = cache_root() / "distill" / f"eval-{data_key(payload)}.pt"
    if path.exists() and not args.no_cache:
        return torch.load(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = encode_prompts(tok, [p["prompt"] for p in prompts])
    data = {"categories": [p["category"] for p in prompts], "prompt_ids": prompt_ids}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        data[name] = generate(model, prompt_ids, temperature, args.eval_new_tokens, args.gen_batch_size,
                              args.eval_seed, eos, log_every=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # an interrupted save is never loaded as the data
    return data


# ---------------------------------------------------------------------------
# Head subset, training, evaluation.
# ---------------------------------------------------------------------------

def choose_head(tok, mass: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` tokens with the most mass, plus the special and newline tokens (sorted ids)."""
    required = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    required |= {i for i in range(len(tok)) if "\n" in (s := tok.decode([i])) and not s.strip()}
    required = {i for i in required if i < mass.shape[0]}
    assert len(required) < size, f"head of {size} tokens cannot hold the {len(required)} required ones"
    chosen = list(required)
    for i in mass.argsort(descending=True).tolist():
        if len(chosen) == size:
            break
        if i not in required:
            chosen.append(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def draft_subset_logits(draft, input_ids: torch.Tensor) -> torch.Tensor:
    """Draft logits over its head subset only: [B, T, S]."""
    hidden = draft.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden @ draft.lm_head.weight.T


def train(args, draft, data: dict, head_ids: torch.Tensor) -> dict:
    vocab = draft.config.vocab_size
    to_subset = torch.full((vocab,), -1, dtype=torch.long)
    to_subset[head_ids] = torch.arange(head_ids.numel())
    for p in draft.parameters():
        p.requires_grad_(False)
    params = [p for m in (draft.model.layers, draft.model.norm) for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    assert not draft.lm_head.weight.requires_grad and not draft.model.embed_tokens.weight.requires_grad
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    seqs = data["seqs"]
    steps_per_epoch = math.ceil(len(seqs) / args.batch_size)
    total = steps_per_epoch * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    warmup = min(args.warmup, total // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    draft.train()
    step, started, history = 0, time.time(), []
    for epoch in range(args.epochs):
        if step == total:
            break
        order = torch.randperm(len(seqs), generator=gen).tolist()
        run_loss = run_w = run_agree = 0.0
        for first in range(0, len(order), args.batch_size):
            if step == total:
                break
            idx = order[first:first + args.batch_size]
            width = max(len(seqs[i]) for i in idx)
            B, k = len(idx), args.topk
            ids = torch.zeros((B, width), dtype=torch.long)
            tprob = torch.zeros((B, width, k))
            tsub = torch.zeros((B, width, k), dtype=torch.long)
            tsub_valid = torch.zeros((B, width, k), dtype=torch.bool)
            w = torch.zeros((B, width))
            for row, i in enumerate(idx):
                n, st = len(seqs[i]), data["starts"][i]
                ids[row, :n] = torch.tensor(seqs[i])
                sub = to_subset[data["ids"][i].long()]
                tprob[row, st:n - 1] = data["probs"][i].float()
                tsub[row, st:n - 1] = sub.clamp_min(0)
                tsub_valid[row, st:n - 1] = sub >= 0
                w[row, st:n - 1] = data["weights"][i]
            logq = F.log_softmax(draft_subset_logits(draft, ids), dim=-1)  # [B, T, S]
            picked = logq.gather(-1, tsub)  # [B, T, k]
            soft = -(tprob * tsub_valid * picked).sum(-1)
            top1 = -(picked[..., 0] * tsub_valid[..., 0])
            loss = (w * (soft + args.top1_weight * top1)).sum() / w.sum()
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            optim.step()
            step += 1
            with torch.no_grad():
                agree = ((logq.argmax(-1) == tsub[..., 0]) & tsub_valid[..., 0]).float()
                cont = w == 1.0
                run_agree += (agree * cont).sum().item()
                run_w += cont.sum().item()
                run_loss += loss.item()
            if step % args.log_every == 0 or first + args.batch_size >= len(order) or step == total:
                print(f"  epoch {epoch + 1}/{args.epochs} step {step}/{total} lr {lr_at(step - 1):.2e} "
                      f"loss {loss.item():.3f} train top-1 agree (cont.) {run_agree / max(run_w, 1):.3f} "
                      f"{time.time() - started:.0f}s", flush=True)
        history.append({"epoch": epoch + 1, "mean_loss": run_loss / max(1, step - epoch * steps_per_epoch),
                        "train_top1_agreement": run_agree / max(run_w, 1)})
    draft.eval()
    for p in params:
        p.requires_grad_(False)
    return {"steps": step, "train_time_s": time.time() - started, "history": history}


@torch.inference_mode()
def evaluate(target, draft, eval_data: dict) -> dict:
    """T=0 agreement on greedy continuations and mean sum min(p, q) at T=1 on sampled ones."""
    head_ids = draft.lm_head.token_ids
    result = {}
    for name in ("greedy", "sampled"):
        per_cat: dict[str, list[float]] = {}
        for cat, prompt, cont in zip(eval_data["categories"], eval_data["prompt_ids"], eval_data[name]):
            if not cont:
                continue
            ids = torch.tensor([prompt + cont])
            lo, hi = len(prompt) - 1, len(prompt) + len(cont) - 1  # positions predicting the continuation
            p_logits = target(input_ids=ids, use_cache=False).logits[0, lo:hi].float()
            q_logits = draft_subset_logits(draft, ids)[0, lo:hi].float()
            if name == "greedy":
                values = (head_ids[q_logits.argmax(-1)] == p_logits.argmax(-1)).float()
            else:
                p = p_logits.softmax(-1)[:, head_ids]
                values = torch.minimum(p, q_logits.softmax(-1)).sum(-1)
            sums = per_cat.setdefault(cat, [0.0, 0])
            sums[0] += values.sum().item()
            sums[1] += values.numel()
        key = "t0_agreement" if name == "greedy" else "t1_sum_min_pq"
        result[key] = sum(s for s, _ in per_cat.values()) / sum(n for _, n in per_cat.values())
        result[key + "_by_category"] = {c: s / n for c, (s, n) in sorted(per_cat.items())}
        result[name + "_positions"] = sum(n for _, n in per_cat.values())
    return result


def default_init_layers(num_layers: int, target_layers: int) -> list[int]:
    first = (num_layers + 1) // 2
    return list(range(first)) + list(range(target_layers - (num_layers - first), target_layers))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m harness.distill", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory of the draft")
    ap.add_argument("--target", default="smollm2", help="embedded target name")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--init-layers", type=int, nargs="+", default=None,
                    help="target layers to copy (default: first half and last half of the stack)")
    ap.add_argument("--head-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    # data
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7],
                    help="one continuation of every training prompt per temperature")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompts", type=int, default=0, help="use only this many training prompts (0: all)")
    ap.add_argument("--gen-batch-size", type=int, default=32)
    ap.add_argument("--teacher-batch-size", type=int, default=8)
    ap.add_argument("--topk", type=int, default=64, help="teacher probabilities kept per position")
    ap.add_argument("--prompt-weight", type=float, default=0.5, help="loss weight of prompt positions")
    ap.add_argument("--no-cache", action="store_true", help="regenerate the data even if cached")
    ap.add_argument("--data-only", action="store_true", help="only generate (and cache) the data")
    # training
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--top1-weight", type=float, default=0.2)
    ap.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0: no limit)")
    ap.add_argument("--log-every", type=int, default=25)
    # evaluation
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--eval-seed", type=int, default=1234)
    ap.add_argument("--eval-prompts", type=int, default=0, help="use only this many evaluation prompts (0: all 60)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not evaluate the untrained draft")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python -m harness.distill " + shlex.join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.models.loading import PLAIN

    model_dir = embedded_model_dir(args.target)
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **PLAIN).eval()
    target.requires_grad_(False)
    init_layers = args.init_layers or default_init_layers(args.layers, target.config.num_hidden_layers)
    assert len(init_layers) == args.layers, "--init-layers must name --layers layers"

    print(f"[distill] training data ({args.temperatures}, {args.max_new_tokens} new tokens) ...", flush=True)
    data = build_training_data(args, target, tok, model_dir)
    positions = sum(len(p) for p in data["probs"])
    print(f"[distill] {data['num_prompts']} prompts, {len(data['seqs'])} sequences, {data['generated_tokens']} "
          f"generated tokens, {positions} training positions (generation {data['gen_time_s']:.0f}s, "
          f"teacher {data['teacher_time_s']:.0f}s)", flush=True)
    print("[distill] evaluation data ...", flush=True)
    eval_data = build_eval_data(args, target, tok, model_dir)
    if args.data_only:
        print(f"[distill] data ready ({time.time() - started:.0f}s); --data-only: stopping here", flush=True)
        return

    head_ids = choose_head(tok, data["mass"], args.head_tokens)
    weighted = sum(w.sum().item() for w in data["weights"])
    coverage = data["mass"][head_ids].sum().item() / weighted
    print(f"[distill] head: {head_ids.numel()} tokens covering {coverage:.4f} of the teacher mass", flush=True)
    torch.manual_seed(args.seed)
    draft = build_shared_draft(target, args.layers, head_ids, init_layers)
    baseline = None
    if not args.skip_baseline:
        baseline = evaluate(target, draft.eval(), eval_data)
        print(f"[distill] untrained (layers {init_layers}): T=0 agreement {baseline['t0_agreement']:.3f}, "
              f"T=1 sum min(p,q) {baseline['t1_sum_min_pq']:.3f}", flush=True)

    print(f"[distill] training {args.layers} layers initialised from {init_layers} ...", flush=True)
    training = train(args, draft, data, head_ids)
    # Evaluate exactly what is stored: the trained weights rounded to fp16.
    with torch.no_grad():
        for m in (draft.model.layers, draft.model.norm):
            for p in m.parameters():
                p.copy_(p.half().float())
    result = evaluate(target, draft, eval_data)
    print(f"[distill] held-out: T=0 agreement {result['t0_agreement']:.3f}, "
          f"T=1 sum min(p,q) {result['t1_sum_min_pq']:.3f}", flush=True)
    print(f"  by category T=0: {json.dumps({k: round(v, 3) for k, v in result['t0_agreement_by_category'].items()})}")
    print(f"  by category T=1: {json.dumps({k: round(v, 3) for k, v in result['t1_sum_min_pq_by_category'].items()})}")

    meta = {
        "made_by": "harness.distill",
        "command": command,
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target": f"embedded:{args.target}",
        "init_layers": init_layers,
        "head_tokens": int(head_ids.numel()),
        "head_teacher_mass_coverage": coverage,
        "data": {
            "training_prompts": data["num_prompts"],
            "sequences": len(data["seqs"]),
            "generated_tokens": data["generated_tokens"],
            "training_positions": positions,
            "generation_time_s": round(data["gen_time_s"], 1),
            "teacher_time_s": round(data["teacher_time_s"], 1),
        },
        "training": {**training, "train_time_s": round(training["train_time_s"], 1)},
        "eval": {"prompts": len(eval_data["prompt_ids"]), "new_tokens": args.eval_new_tokens,
                 "seed": args.eval_seed, **result, "untrained": baseline},
        "total_time_s": round(time.time() - started, 1),
        "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "threads": args.threads,
    }
    save_shared_draft(draft, args.out, meta)
    size = (args.out / "weights.safetensors").stat().st_size
    print(f"[distill] saved {args.out} ({size / 1e6:.1f} MB weights) in {meta['total_time_s']:.0f}s total", flush=True)


def cli() -> None:
    """`python -m harness.distill`."""
    main()
