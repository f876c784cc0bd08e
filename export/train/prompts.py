"""Varied training prompts, composed by this module (source "varied"): the kinds of request a chat assistant
gets (writing, role play, reasoning, math, coding, extraction, science, humanities), with length, format and
audience constraints and follow-up instructions, so that the drafters see more than short one-line requests.
Everything here is written for this project; seeded and reproducible. The MT-Bench prompts are never used."""
from __future__ import annotations

import random

SUBJECTS = [
    "a weekend trip to the mountains", "a new smartphone app for learning languages", "a community bake sale",
    "the opening of a small bookshop", "a city bike-sharing scheme", "a school science fair", "a jazz festival",
    "a solar-powered backpack", "learning to play the guitar as an adult", "a charity marathon",
    "a visit to an old lighthouse", "a rainy afternoon in a café", "moving to a new country", "a robot vacuum",
    "a local farmers' market", "the first day at a new job", "a museum of ancient maps", "a winter camping trip",
    "an electric scooter", "a board game night", "a family reunion", "a volunteer beach clean-up",
    "a cooking class for beginners", "a remote island", "a smart thermostat", "a neighbourhood library",
    "a high-school reunion", "a houseplant that is hard to kill", "a train journey across Europe",
    "a small vegetable garden", "a week without social media", "a hiking boot", "a night at the observatory",
]
KINDS = [
    "blog post", "short story", "persuasive essay", "product description", "speech", "news report",
    "diary entry", "letter to a friend", "review", "newsletter", "press release", "poem", "advertisement",
    "travel guide entry", "dialogue between two friends", "limerick", "cover letter", "motivational message",
]
CONSTRAINTS = [
    "in under 100 words", "in exactly three paragraphs", "using a friendly, informal tone", ("for an audience of "
    "teenagers"), "with a catchy title", "that ends with a question to the reader", "using bullet points",
    "in a formal tone", "with a surprising twist at the end", "that a child could understand",
    "in the style of a sports commentator", "with a short summary at the start", "in five sentences",
    "that includes at least one statistic", "using simple words only", "with headings for each section",
]
FOLLOW_UPS = [
    "Then summarize your answer in one sentence.", "Then rewrite it in a more formal tone.",
    "Afterwards, list two ways it could be improved.", "Then explain your choices briefly.",
    "Finally, give it a title.", "Then translate the first sentence into French.",
    "Then make it half as long.", "Afterwards, suggest a follow-up question.",
]
PERSONAS = [
    "a medieval knight", "a tour guide in Rome", "a detective in the 1920s", "a personal fitness coach",
    "a customer support agent for an internet provider", "an astronaut on a space station", "a pirate captain",
    "a friendly librarian", "a strict but fair chess teacher", "a chef in a busy restaurant", ("a time traveller "
    "from the year 2300"), "a wildlife photographer", "a career counsellor", "a travel agent", "a wise old owl",
    "a startup founder pitching to investors", "a museum curator", "a weather forecaster", "a village doctor",
]
PERSONA_TASKS = [
    "Describe your typical day.", "Introduce yourself to a new visitor.", "Give advice to someone who {s}.",
    "Explain what you love most about your work.", "Answer this question: what should I do when {s}?",
    "Tell a short story about your most memorable day.", "Convince me to try {t}.",
    "Describe the biggest challenge you face and how you deal with it.",
]
SITUATIONS = [
    "feels stressed before an exam", "wants to save money", "cannot sleep well", "is learning to cook",
    "has just moved to a new city", "wants to get fit", "is nervous about public speaking",
    "keeps forgetting appointments", "wants to read more books", "disagrees with a coworker",
    "is planning a first trip abroad", "wants to start a small business",
]
CONCEPTS = [
    "photosynthesis", "entropy", "supply and demand", "natural selection", "the greenhouse effect", "inertia",
    "compound interest", "machine learning", "the placebo effect", "electric circuits", "DNA replication",
    "opportunity cost", "plate tectonics", "vaccination", "recursion in programming", "the speed of light",
    "blockchain", "osmosis", "the water cycle", "public-key cryptography", "black holes", "inflation",
    "antibiotic resistance", "binary numbers", "the scientific method", "gravity", "neural networks",
    "nuclear fission", "sound waves", "ecosystems", "the immune system", "cloud computing", "magnetism",
]
PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "a hard drive"), ("speed", "velocity"),
    ("a democracy", "a monarchy"), ("stocks", "bonds"), ("TCP", "UDP"), ("mitosis", "meiosis"),
    ("an atom", "a molecule"), ("a list", "a tuple in Python"), ("renewable", "non-renewable energy"),
    ("a comet", "an asteroid"), ("revenue", "profit"), ("a simile", "a metaphor"), ("AC", "DC current"),
]
STEM_TEMPLATES = [
    "Explain {c} and give an everyday example.", "How would you explain {c} to a high-school student?",
    "What are the most common misunderstandings about {c}?", "Describe how {c} works, step by step.",
    "Why does {c} matter in everyday life? Give two examples.", "Write a short quiz with answers about {c}.",
    "What is the difference between {a} and {b}?", "Compare {a} and {b} in a short table.",
]
HUMANITIES = [
    "the Industrial Revolution", "the fall of the Roman Empire", "the invention of the printing press",
    "the Renaissance", "the Cold War", "the abolition of slavery", "the spread of the Internet",
    "the Silk Road", "the French Revolution", "the space race", "globalization", "the rise of cities",
    "the women's suffrage movement", "the history of money", "the Olympic Games", "the invention of writing",
]
HUMANITIES_TEMPLATES = [
    "Discuss the main causes and effects of {h}.", "How did {h} change daily life for ordinary people?",
    "What lessons can we learn today from {h}?", "Write a short essay on {h} for a history class.",
    "Describe {h} from two different points of view.", "Give a timeline of the key events of {h}.",
]
CODE_TASKS = [
    "reverses the words of a sentence", "checks whether two strings are anagrams", ("finds the second largest "
    "number in a list"), "computes the median of a list of numbers", "counts the lines of a text file",
    "converts a Roman numeral to an integer", "implements binary search", ("finds the longest common prefix of "
    "a list of strings"), "checks whether brackets in a string are balanced", ("returns the prime factors of a "
    "number"), "implements a stack with push and pop", "merges overlapping intervals", ("rotates a list by k "
    "positions"), "removes vowels from a string", "finds all pairs in a list that sum to a target",
    "computes the n-th row of Pascal's triangle", "parses a date string like 2024-03-15", "implements bubble sort",
    "transposes a matrix", "counts the islands in a grid of 0s and 1s",
]
LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C#"]
CODE_EXTRAS = [
    "", " Include comments.", " Add a few test cases.", " Explain its time complexity.",
    " Handle invalid input gracefully.", " Keep it as short as possible.",
]
SNIPPETS = [
    "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x\n    return total",
    "function g(s) {\n  return s.split('').reverse().join('') === s;\n}",
    "def h(n):\n    if n < 2:\n        return n\n    return h(n - 1) + h(n - 2)",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "def avg(xs):\n    return sum(xs) / len(xs)",
    "for i in range(1, 101):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)",
    "int count(int *a, int n) {\n  int c = 0;\n  for (int i = 0; i <= n; i++) if (a[i] > 0) c++;\n  return c;\n}",
]
CODE_QUESTIONS = [
    "Explain what this code does:\n\n{s}", "Is there a bug in this code? If so, fix it.\n\n{s}",
    "Rewrite this code to be more readable:\n\n{s}", "What is the time complexity of this code?\n\n{s}",
]
NAMES = ["Alice", "Bruno", "Chen", "Dana", "Elif", "Felix", "Gita", "Hassan", "Ivy", "Jamal", "Keiko", "Liam",
         "Maya", "Nils", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Austin", "Krakow", "Lima", "Perth", "Seoul", "Oslo",
          "Cairo"]
COMPANIES = ["Brightleaf", "Northwind Labs", "Copperfield Foods", "BlueHarbor", "Quantix", "Green Valley Bikes"]
PRODUCTS = ["wireless earbuds", "a coffee grinder", "a standing desk", "a fitness tracker", "a laptop bag",
            "a rice cooker", "a reading lamp", "hiking socks"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def _writing(r: random.Random) -> str:
    return f"Write a {r.choice(KINDS)} about {r.choice(SUBJECTS)} {r.choice(CONSTRAINTS)}."


def _roleplay(r: random.Random) -> str:
    task = r.choice(PERSONA_TASKS).format(s=r.choice(SITUATIONS), t=r.choice(SUBJECTS))
    return r.choice(["Imagine you are {p}. {t}", "Pretend to be {p}. {t}", "You are {p}. Stay in character. {t}"]
                    ).format(p=r.choice(PERSONAS), t=task)


def _reasoning(r: random.Random) -> str:
    a, b, c, d = r.sample(NAMES, 4)
    n, m = r.randint(3, 9), r.randint(2, 8)
    return r.choice([
        (f"{a} is taller than {b}. {c} is shorter than {b} but taller than {d}. Who is the tallest and who is the "
        f"shortest? Explain your reasoning."),
        (f"If {n} workers can paint {n} fences in {m} hours, how long do {2 * n} workers need to paint {2 * n} "
        f"fences? Think step by step."),
        f"{a} is {b}'s sister. {c} is {a}'s father. What is the relationship between {c} and {b}?",
        (f"Today is {r.choice(['Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday'])}. What day of the week "
        f"will it be in {n * 7 + m} days? Explain."),
        (f"{a} walks {n} km north, then {m} km east, then {n} km south. How far is {a} from the starting point, "
        f"and in which direction?"),
        (f"All {r.choice(['cats', 'birds', 'engineers', 'poets'])} in this town like music. {a} lives in this town "
        f"and does not like music. What can we conclude about {a}? Explain."),
        (f"A bag has {n} red balls and {m} blue balls. If you draw two balls without looking, what is the "
        f"probability that both are red? Show your work."),
        (f"{a}, {b} and {c} each own one pet: a cat, a dog or a fish. {a} is allergic to fur, and {b} does not own "
        f"the dog. Who owns which pet?"),
    ])


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 30), r.randint(2, 15), r.randint(1, 60)
    return r.choice([
        (f"A shop sells {r.choice(PRODUCTS)} for ${a * 10}. It is discounted by {c % 50 + 5}%. What is the new "
        f"price? Then find the price after a further 10% discount."),
        f"Find the area of a triangle with vertices at (0, 0), ({a}, 0) and (0, {b}).",
        f"Solve the system of equations: x + y = {a + b}, x - y = {a - b}.",
        f"What is the sum of all integers from 1 to {a * 10}? Explain the method.",
        f"A car travels {a * 10} km in {b} hours. What is its average speed? How long would {c * 10} km take?",
        f"If f(x) = {b}x^2 - {a}x + {c}, what is f({b})? Show each step.",
        f"Convert {a * 100} minutes into hours and minutes.",
        (f"The ratio of boys to girls in a class is {b}:{a}, and there are {(a + b) * 3} students. How many are "
        f"girls?"),
        f"What is {a}% of {c * 20}, and what percentage of {c * 20} is {a * 2}?",
        (f"A rectangle's length is {a} cm more than its width, and its perimeter is {4 * b + 2 * a} cm. Find its "
        f"dimensions."),
        f"Is {a * b + 1} a prime number? Explain how you checked.",
    ])


def _coding(r: random.Random) -> str:
    if r.random() < 0.3:
        return r.choice(CODE_QUESTIONS).format(s=r.choice(SNIPPETS))
    return f"Write a {r.choice(LANGUAGES)} function that {r.choice(CODE_TASKS)}.{r.choice(CODE_EXTRAS)}"


def _passage(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    city, company, month = r.choice(CITIES), r.choice(COMPANIES), r.choice(MONTHS)
    return r.choice([
        (f"On {r.randint(1, 28)} {month} {r.randint(2015, 2025)}, {a} opened a new office of {company} in {city}. "
        f"The company hired {r.randint(10, 90)} people that year, and its sales grew by {r.randint(5, 40)}%. "
        f"{b}, who leads the design team, said the move was the best decision they had made."),
        (f"Review 1: The {r.choice(PRODUCTS)} arrived late but works perfectly. Review 2: Broke after two weeks, "
        f"very disappointed. Review 3: Decent quality for the price, though the instructions were confusing."),
        (f"{a} flew from {city} to {r.choice(CITIES)} in {month}, stayed for {r.randint(2, 14)} days, and spent "
        f"${r.randint(300, 3000)} on the trip. {b} joined for the last three days."),
        (f"{company} reported revenue of ${r.randint(2, 90)} million in {r.randint(2018, 2025)}, up from "
        f"${r.randint(1, 60)} million the year before. The CEO, {a}, credited the growth to {r.choice(PRODUCTS)}."),
    ])


def _extraction(r: random.Random) -> str:
    return r.choice([
        "Extract all names, places and dates from the text below and return them as JSON.\n\n{p}",
        "Summarize the following text in one sentence.\n\n{p}",
        "Read the text below and answer: what are the key numbers, and what do they mean?\n\n{p}",
        "Rate the sentiment of the following text as positive, negative or mixed, and explain why.\n\n{p}",
        "Turn the following text into a short bulleted list of facts.\n\n{p}",
        "Write three questions that can be answered from this text, with their answers.\n\n{p}",
    ]).format(p=_passage(r))


def _stem(r: random.Random) -> str:
    a, b = r.choice(PAIRS)
    return r.choice(STEM_TEMPLATES).format(c=r.choice(CONCEPTS), a=a, b=b)


def _humanities(r: random.Random) -> str:
    return r.choice(HUMANITIES_TEMPLATES).format(h=r.choice(HUMANITIES))


CATEGORIES = [_writing, _roleplay, _reasoning, _math, _coding, _extraction, _stem, _humanities]
OPEN_ENDED = {_writing, _roleplay, _stem, _humanities}


def varied_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct prompts, the categories in turn; a third of the open-ended ones carry a follow-up."""
    r = random.Random(f"varied-{seed}")
    out, seen = [], set()
    for i in range(50 * n):
        if len(out) == n:
            break
        category = CATEGORIES[i % len(CATEGORIES)]
        text = category(r)
        if category in OPEN_ENDED and r.random() < 1 / 3:
            text = f"{text} {r.choice(FOLLOW_UPS)}"
        if text not in seen:
            seen.add(text)
            out.append({"prompt_id": f"varied_{len(out)}", "source": "varied", "prompt": text})
    return out
