"""Generate the project's own English training corpus: short documents from a hand-written grammar.

    python scripts/make_corpus.py            # writes assets/data/stories/corpus.txt (~2 MB)

Every word and template below was written for this project; nothing is downloaded or copied. The
output is one document per line (no newline inside a document) and is byte-identical on every run:
all randomness comes from one ``random.Random(SEED)`` and only ordered containers are iterated.

The grammar is built so that a small language model has something to learn beyond word
frequencies:
  * a named character is introduced with attributes (age, pet and its name, favourite colour, town,
    a parent and their job) and is later referred to by pronoun; the attributes stay consistent
    within a document and are asked about in question/answer pairs at the end of some stories;
  * small arithmetic in words ("She had five plums and gave two to Ben, so she had three left");
  * ordered sequences: days of the week, seasons, counting;
  * dialogue lines in quotes, letters and diary entries.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
TARGET_BYTES = 2_000_000  # stop adding documents once the file would reach this size
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "assets" / "data" / "stories" / "corpus.txt"

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

GIRL_NAMES = ["Mia", "Lily", "Anna", "Rosa", "Nora", "Ella", "Ivy", "Ruby", "Maya", "Zoe", "Lena",
              "Clara", "Hana", "June", "Tess", "Alma", "Greta", "Pia", "Sara", "Dina"]
BOY_NAMES = ["Tom", "Ben", "Sam", "Leo", "Max", "Finn", "Owen", "Jack", "Noah", "Eli", "Omar",
             "Theo", "Hugo", "Ravi", "Milo", "Luca", "Kai", "Arlo", "Ned", "Pablo"]

PRONOUNS = {  # subject, object, possessive
    "girl": ("she", "her", "her"),
    "boy": ("he", "him", "his"),
}

# name, legs, sound verb, things it likes to do (past tense, no subject)
PETS = [
    ("dog", 4, "barked", ["chased its tail", "dug a hole in the garden", "ran after a stick",
                          "slept by the door"]),
    ("cat", 4, "purred", ["climbed onto the roof", "chased a little moth", "slept in a patch of sun",
                          "knocked a cup off the table"]),
    ("rabbit", 4, "thumped its foot", ["ate a whole carrot", "hopped around the garden",
                                       "hid under a chair"]),
    ("duck", 2, "quacked", ["swam in the pond", "walked in a straight line", "splashed in a puddle"]),
    ("parrot", 2, "squawked", ["said hello to everyone", "sat on the top of the door",
                               "copied the sound of the kettle"]),
    ("goat", 4, "bleated", ["ate the edge of a blanket", "jumped onto a big rock",
                            "pushed the gate open"]),
    ("turtle", 4, "stayed quiet", ["walked very slowly across the floor", "hid inside its shell",
                                   "ate a piece of lettuce"]),
    ("hamster", 4, "squeaked", ["ran in its wheel", "filled its cheeks with seeds",
                                "built a nest of paper"]),
]
PET_NAMES = ["Biscuit", "Pepper", "Button", "Maple", "Pickle", "Socks", "Clover", "Ziggy", "Noodle",
             "Pebble", "Waffle", "Sprout", "Bean", "Juniper", "Toffee", "Domino"]

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "white", "gray"]
TOWNS = ["Greenhill", "Riverton", "Oakfield", "Stonebridge", "Maplewood", "Lakeside", "Sunvale",
         "Pinecrest", "Brookside", "Fernley", "Ashford", "Willowby"]
HOMES = ["a small house", "a blue house", "a farm", "a flat above a bakery", "a cottage near the river",
         "a tall house on a hill", "a little house with a red door", "a house next to the park"]
ADJECTIVES = ["kind", "curious", "brave", "quiet", "cheerful", "clever", "shy", "busy", "gentle",
              "funny"]
FEELINGS = ["happy", "tired", "proud", "calm", "excited", "sleepy", "glad", "thankful"]

# Countable things, as (singular, plural), so counts agree in number.
FOODS = [("apple", "apples"), ("pear", "pears"), ("plum", "plums"), ("cookie", "cookies"),
         ("egg", "eggs"), ("orange", "oranges"), ("muffin", "muffins"), ("carrot", "carrots"),
         ("cherry", "cherries"), ("peach", "peaches"), ("tomato", "tomatoes"), ("strawberry", "strawberries")]
THINGS = [("marble", "marbles"), ("shell", "shells"), ("stone", "stones"), ("sticker", "stickers"),
          ("leaf", "leaves"), ("feather", "feathers"), ("pencil", "pencils"), ("coin", "coins"),
          ("button", "buttons"), ("card", "cards")]
TOYS = ["kite", "ball", "hat", "scarf", "book", "cup", "boat", "drum", "box", "bike", "umbrella",
        "backpack", "teddy bear", "yo-yo"]

# parent word, pronoun key
PARENTS = [("mother", "girl"), ("father", "boy"), ("grandmother", "girl"), ("grandfather", "boy"),
           ("aunt", "girl"), ("uncle", "boy")]
# job, what the job does (present and past tense, third person), a way to help (bare verb phrase)
JOBS = [
    ("baker", "makes bread and cakes", "made bread and cakes", "carry the trays of bread"),
    ("farmer", "grows wheat and looks after the cows", "grew wheat and looked after the cows", "feed the hens"),
    ("teacher", "teaches children to read and write", "taught children to read and write",
     "put the books back on the shelf"),
    ("doctor", "helps people who are sick", "helped people who were sick", "sort the bandages"),
    ("painter", "paints pictures of the sea", "painted pictures of the sea", "wash the brushes"),
    ("fisher", "catches fish in a small boat", "caught fish in a small boat", "fold the nets"),
    ("builder", "builds houses and walls", "built houses and walls", "carry the small bricks"),
    ("gardener", "grows flowers in the town park", "grew flowers in the town park", "water the roses"),
    ("cook", "makes soup in a busy kitchen", "made soup in a busy kitchen", "wash the carrots"),
    ("bus driver", "drives the big green bus", "drove the big green bus", "count the tickets"),
]

# place, activities there (past tense, no subject)
PLACES = [
    ("the park", ["played on the swings", "fed the ducks", "ran around the big tree",
                  "sat on a bench and watched the birds"]),
    ("the market", ["bought fresh bread", "looked at the fruit stalls", "carried the heavy bag home"]),
    ("the library", ["read a book about the moon", "found a book about trains",
                     "listened to a story"]),
    ("the beach", ["built a sand castle", "looked for shells", "walked along the water"]),
    ("the river", ["threw small stones into the water", "watched the boats go by",
                   "saw a fish jump"]),
    ("the forest", ["picked up pine cones", "followed a little path", "heard an owl"]),
    ("the garden", ["planted some seeds", "watered the flowers", "pulled out the weeds"]),
    ("the school", ["painted a picture", "sang a song with the class", "learned to count to one hundred"]),
    ("the farm", ["gave hay to the horses", "collected eggs from the hens", "rode on the tractor"]),
    ("the hill", ["rolled down the grass", "flew a kite in the wind", "looked at the whole town"]),
]

HIDING_SPOTS = ["under the bed", "behind the sofa", "in the kitchen", "in the garden",
                "on the shelf", "in the car", "under the table", "in the bathtub", "behind the door",
                "in the toy box"]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SEASONS = ["spring", "summer", "autumn", "winter"]
SEASON_FACTS = {
    "spring": ["the flowers open", "the birds build nests", "the rain is soft and warm",
               "the trees grow new leaves"],
    "summer": ["the days are long and hot", "children swim in the lake", "the fruit gets ripe",
               "the sun sets late"],
    "autumn": ["the leaves turn red and yellow", "the wind blows the leaves down",
               "farmers bring in the harvest", "the nights get longer"],
    "winter": ["snow covers the ground", "the ponds freeze", "people wear warm coats",
               "the days are short and cold"],
}
SEASON_ACTIVITIES = {
    "spring": ["plant seeds", "look for baby birds", "pick flowers"],
    "summer": ["swim in the lake", "eat cold fruit", "sleep with the window open"],
    "autumn": ["jump in piles of leaves", "collect acorns", "drink warm apple juice"],
    "winter": ["build a snowman", "slide down the hill", "sit by the fire"],
}
WEATHER = [
    ("sunny", "The sun was bright and the sky was clear."),
    ("rainy", "Gray clouds filled the sky and it began to rain."),
    ("windy", "The wind blew so hard that the trees bent."),
    ("snowy", "Soft white snow fell all morning."),
    ("foggy", "A thick fog covered the streets, and nobody could see very far."),
]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]


def words(n: int) -> str:
    """0..100 as English words: 42 -> 'forty-two'."""
    if n < 20:
        return ONES[n]
    if n == 100:
        return "one hundred"
    tens, ones = divmod(n, 10)
    return TENS[tens] + ("-" + ONES[ones] if ones else "")


def count(n: int, noun: tuple[str, str]) -> str:
    """'one apple', 'three apples', 'no apples'."""
    if n == 0:
        return "no " + noun[1]
    return f"{words(n)} {noun[0] if n == 1 else noun[1]}"


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def join_list(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


# ---------------------------------------------------------------------------------------------
# Characters
# ---------------------------------------------------------------------------------------------


@dataclass
class Character:
    """A story's hero, with attributes that stay fixed for the whole document."""

    name: str
    kind: str  # "girl" | "boy"
    age: int
    adjective: str
    color: str
    town: str
    home: str
    food: tuple[str, str]
    pet: tuple
    pet_name: str
    parent: str
    parent_kind: str
    job: tuple[str, str, str, str]
    toy: str

    def ctx(self) -> dict[str, str]:
        """Template fields: {name}, {he}/{He}, {him}, {his}/{His}, {pet}, ... ."""
        he, him, his = PRONOUNS[self.kind]
        p_he, p_him, p_his = PRONOUNS[self.parent_kind]
        return {
            "name": self.name, "kind": self.kind, "age": words(self.age), "adj": self.adjective,
            "he": he, "He": cap(he), "him": him, "his": his, "His": cap(his),
            "color": self.color, "town": self.town, "home": self.home,
            "food": self.food[0], "foods": self.food[1],
            "pet": self.pet[0], "pet_name": self.pet_name, "pet_sound": self.pet[2],
            "parent": self.parent, "p_he": p_he, "P_he": cap(p_he), "p_him": p_him, "p_his": p_his,
            "job": self.job[0], "job_does": self.job[1], "job_did": self.job[2], "job_help": self.job[3], "toy": self.toy,
        }


def make_character(rng: random.Random, avoid: tuple[str, ...] = ()) -> Character:
    kind = rng.choice(["girl", "boy"])
    names = [n for n in (GIRL_NAMES if kind == "girl" else BOY_NAMES) if n not in avoid]
    parent, parent_kind = rng.choice(PARENTS)
    return Character(
        name=rng.choice(names), kind=kind, age=rng.randint(4, 11), adjective=rng.choice(ADJECTIVES),
        color=rng.choice(COLORS), town=rng.choice(TOWNS), home=rng.choice(HOMES),
        food=rng.choice(FOODS), pet=rng.choice(PETS), pet_name=rng.choice(PET_NAMES),
        parent=parent, parent_kind=parent_kind, job=rng.choice(JOBS), toy=rng.choice(TOYS),
    )


def fill(templates: list[str], rng: random.Random, **ctx: str) -> str:
    return rng.choice(templates).format(**ctx)


# ---------------------------------------------------------------------------------------------
# Story parts. Each returns a list of sentences; ``c`` is the hero's template context, ``f`` a friend's.
# ---------------------------------------------------------------------------------------------

# Opening sentence, and the facts it already states (so no later sentence repeats them).
INTROS = [
    ("Once upon a time, there was a {adj} {kind} named {name}.", ()),
    ("{name} was a {adj} {kind} who lived in {home} in {town}.", ("town",)),
    ("In the town of {town}, there lived a {kind} called {name}.", ()),
    ("This is a story about {name}, a {adj} little {kind}.", ()),
    ("Not long ago, in {town}, there was a {kind} whose name was {name}.", ()),
]
# One sentence is drawn from each chosen group; the key records which facts the reader was told.
FACTS = [
    ("age", ["{He} was {age} years old.", "{name} was {age} years old.", "{He} had just turned {age}."]),
    ("town", ["{He} lived in {home} in {town}.", "{His} home was {home} in {town}."]),
    ("color", ["{His} favorite color was {color}.", "{He} liked the color {color} more than any other color.",
               "{name} loved everything that was {color}."]),
    ("pet", ["{He} had a {pet} named {pet_name}.", "{name} had a pet {pet} called {pet_name}.",
             "{His} best friend at home was a {pet} named {pet_name}."]),
    ("food", ["{He} loved to eat {foods}.", "{His} favorite food was {foods}."]),
    ("job", ["{His} {parent} was a {job} who {job_did}.", "{His} {parent} worked as a {job}."]),
]


def part_intro(rng: random.Random, c: dict) -> tuple[list[str], set[str]]:
    """The opening sentence and 3-6 attribute sentences; also returns the keys of the facts told.

    The pet is always introduced because later parts refer to it by name.
    """
    template, told = rng.choice(INTROS)
    out, told = [template.format(**c)], set(told)
    facts = [kv for kv in FACTS if kv[0] not in told]
    rng.shuffle(facts)
    chosen = facts[: rng.randint(3, len(facts))]
    if "pet" not in [k for k, _ in chosen]:
        chosen.append(next(kv for kv in facts if kv[0] == "pet"))
    for key, group in chosen:
        out.append(fill(group, rng, **c))
        told.add(key)
    return out, told


def part_counting(rng: random.Random, c: dict, f: dict) -> list[str]:
    kind = rng.randrange(4)
    noun = (c["food"], c["foods"]) if rng.random() < 0.5 else rng.choice(THINGS)
    if kind == 0:  # take away
        a = rng.randint(3, 12)
        b = rng.randint(1, a - 1)
        return [
            f"One morning, {c['name']} found {count(a, noun)} in a basket.",
            f"{c['He']} gave {words(b)} to {f['name']}.",
            rng.choice([f"Now {c['he']} had {count(a - b, noun)} left.",
                        f"{words(a).capitalize()} take away {words(b)} is {words(a - b)}, so {c['he']} "
                        f"had {count(a - b, noun)} left."]),
        ]
    if kind == 1:  # add
        a = rng.randint(1, 10)
        b = rng.randint(1, 10)
        return [
            f"{c['name']} had {count(a, noun)}.",
            f"{c['His']} {c['parent']} gave {c['him']} {words(b)} more.",
            rng.choice([f"Now {c['he']} had {count(a + b, noun)}.",
                        f"{words(a).capitalize()} and {words(b)} make {words(a + b)}, so {c['he']} had "
                        f"{count(a + b, noun)} in all."]),
        ]
    if kind == 2:  # groups
        a = rng.randint(2, 5)
        b = rng.randint(2, 5)
        return [
            f"{c['name']} put the {noun[1]} into {words(a)} little piles.",
            f"Each pile had {count(b, noun)}.",
            f"{words(a).capitalize()} piles of {words(b)} make {words(a * b)}, so there were "
            f"{count(a * b, noun)} in all.",
        ]
    # legs of the pet
    n = rng.randint(2, 4)
    legs = c["_pet_legs"]
    return [
        f"{c['pet_name']} the {c['pet']} has {words(legs)} legs.",
        f"One day {c['name']} saw {words(n)} more {c['pet']}s at {rng.choice(PLACES)[0]}.",
        f"{c['He']} counted their legs: {words(n)} {c['pet']}s with {words(legs)} legs each have "
        f"{words(n * legs)} legs.",
    ]


def part_days(rng: random.Random, c: dict) -> list[str]:
    start = rng.randrange(7)
    n = rng.randint(2, 4)
    place, acts = rng.choice(PLACES)
    out = [f"On {DAYS[start]}, {c['name']} went to {place} and {rng.choice(acts)}."]
    for k in range(1, n):
        day = DAYS[(start + k) % 7]
        place, acts = rng.choice(PLACES)
        out.append(rng.choice([
            f"The next day was {day}. {c['He']} went to {place} and {rng.choice(acts)}.",
            f"On {day}, {c['he']} went to {place}, where {c['he']} {rng.choice(acts)}.",
            f"After {DAYS[(start + k - 1) % 7]} came {day}. That day {c['name']} went to {place} and "
            f"{rng.choice(acts)}.",
        ]))
        if day in ("Saturday", "Sunday") and rng.random() < 0.5:
            out.append(f"{day} is part of the weekend, so there was no school.")
    return out


def part_season(rng: random.Random, c: dict) -> list[str]:
    i = rng.randrange(4)
    s, nxt = SEASONS[i], SEASONS[(i + 1) % 4]
    return [
        rng.choice([f"It was {s} in {c['town']}.", f"{cap(s)} had come to {c['town']}."]),
        "In {}, {} and {}.".format(s, *rng.sample(SEASON_FACTS[s], 2)),
        f"{c['name']} liked to {rng.choice(SEASON_ACTIVITIES[s])}.",
        rng.choice([f"After {s} comes {nxt}.", f"When {s} is over, {nxt} begins.",
                    f"{c['He']} knew that {nxt} would come after {s}."]),
        f"In {nxt}, {rng.choice(SEASON_FACTS[nxt])}.",
    ]


def part_dialogue(rng: random.Random, c: dict, f: dict) -> list[str]:
    place, acts = rng.choice(PLACES)
    act = rng.choice(acts)
    out = [
        rng.choice([f"One day, {f['name']} came to visit.", f"After lunch, {f['name']} knocked on the door.",
                    f"{c['name']}'s friend {f['name']} came over to play."]),
        f"\"Hello, {c['name']}!\" said {f['name']}. \"Do you want to go to {place} with me?\"",
        rng.choice([f"\"Yes, I would love to,\" said {c['name']}. \"But first I have to feed {c['pet_name']}.\"",
                    f"\"Yes!\" said {c['name']}. \"Can {c['pet_name']} come too?\"",
                    f"\"Let me ask my {c['parent']},\" said {c['name']}."]),
    ]
    if rng.random() < 0.5:
        out.append(f"{c['His']} {c['parent']} smiled and said, \"Yes, but come home before dinner.\"")
    out.append(f"So {c['name']} and {f['name']} went to {place}. They {act}.")
    out.append(rng.choice([f"\"This is the best day ever,\" said {f['name']}.",
                           f"\"Let us come back tomorrow,\" said {c['name']}.",
                           f"\"I am so {rng.choice(FEELINGS)},\" {c['he']} said."]))
    return out


def part_lost(rng: random.Random, c: dict) -> list[str]:
    spots = rng.sample(HIDING_SPOTS, rng.randint(3, 5))
    out = [f"One evening, {c['name']} could not find {c['his']} {c['color']} {c['toy']}."]
    for spot in spots[:-1]:
        out.append(rng.choice([f"{c['He']} looked {spot}, but it was not there.",
                               f"It was not {spot}."]))
    out.append(f"At last {c['he']} found it {spots[-1]}.")
    if rng.random() < 0.5:
        out.append(f"{c['pet_name']} had carried it there!")
    out.append(rng.choice([f"\"There you are!\" said {c['name']}.",
                           f"{c['He']} was glad to have {c['his']} {c['color']} {c['toy']} back."]))
    return out


def part_pet(rng: random.Random, c: dict) -> list[str]:
    acts = c["_pet_acts"]
    a, b = rng.sample(acts, 2)
    return [
        f"One afternoon, {c['pet_name']} {a}.",
        f"Then {c['pet_name']} {b} and {c['pet_sound']}.",
        f"{c['name']} laughed. \"{c['pet_name']}, you silly {c['pet']}!\" {c['he']} said.",
        rng.choice([f"{c['He']} gave {c['pet_name']} a hug.",
                    f"{c['pet_name']} looked at {c['him']} and {c['pet_sound']} again."]),
    ]


def part_job(rng: random.Random, c: dict) -> list[str]:
    return [
        f"{c['name']}'s {c['parent']} is a {c['job']}.",
        f"Every day {c['p_he']} {c['job_does']}.",
        f"On {rng.choice(DAYS)}, {c['name']} went to work with {c['p_him']} and helped {c['p_him']} "
        f"{c['job_help']}.",
        rng.choice([f"\"Thank you for your help,\" said {c['name']}'s {c['parent']}.",
                    f"\"You are a good helper,\" said {c['his']} {c['parent']}.",
                    f"{c['He']} felt {rng.choice(FEELINGS)}."]),
    ]


def part_weather(rng: random.Random, c: dict) -> list[str]:
    kind, sentence = rng.choice(WEATHER)
    out = [f"The next morning was {kind}.", sentence]
    if kind == "rainy":
        out.append(f"{c['name']} took {c['his']} umbrella and jumped in the puddles.")
    elif kind == "snowy":
        out.append(f"{c['name']} put on a warm {c['color']} coat and went outside.")
    elif kind == "windy":
        out.append(f"{c['name']} held on tight to {c['his']} {c['toy']}.")
    else:
        out.append(f"{c['name']} and {c['pet_name']} went for a walk.")
    return out


ENDINGS = [
    "That night, {name} went to bed {feeling}.",
    "{He} fell asleep and dreamed about {pet_name}.",
    "It had been a good day for {name}.",
    "{name} smiled. {He} felt {feeling}.",
    "And that is the end of the story about {name} and {pet_name}.",
]


def questions(rng: random.Random, c: dict) -> list[str]:
    """Questions whose answers are stated in the story; they reward tracking the character."""
    qa = [
        ("pet", f"What is the name of {c['name']}'s {c['pet']}?", f"{c['name']}'s {c['pet']} is called {c['pet_name']}."),
        ("pet", f"What kind of pet does {c['name']} have?", f"{c['He']} has a {c['pet']}."),
        ("town", f"Where does {c['name']} live?", f"{c['He']} lives in {c['town']}."),
        ("color", f"What is {c['name']}'s favorite color?", f"{c['His']} favorite color is {c['color']}."),
        ("age", f"How old is {c['name']}?", f"{c['He']} is {c['age']} years old."),
        ("food", f"What does {c['name']} like to eat?", f"{c['He']} likes to eat {c['foods']}."),
        ("job", f"What does {c['name']}'s {c['parent']} do?", f"{c['His']} {c['parent']} is a {c['job']}."),
    ]
    # Only ask about facts the intro actually stated.
    qa = [(q, a) for key, q, a in qa if key in c["_told"]]
    out = []
    for q, a in rng.sample(qa, min(len(qa), rng.randint(1, 3))):
        out.append(f"Question: {q} Answer: {a}")
    return out


def story(rng: random.Random) -> str:
    hero = make_character(rng)
    friend = make_character(rng, avoid=(hero.name,))
    c, f = hero.ctx(), friend.ctx()
    c["_pet_legs"], c["_pet_acts"] = hero.pet[1], hero.pet[3]

    intro, c["_told"] = part_intro(rng, c)

    parts = [
        lambda: part_counting(rng, c, f), lambda: part_days(rng, c), lambda: part_season(rng, c),
        lambda: part_dialogue(rng, c, f), lambda: part_lost(rng, c), lambda: part_pet(rng, c),
        lambda: part_job(rng, c), lambda: part_weather(rng, c),
    ]
    order = rng.sample(range(len(parts)), rng.randint(2, 4))
    body = [s for i in order for s in parts[i]()]
    end = [fill(ENDINGS, rng, feeling=rng.choice(FEELINGS), **c)]
    out = intro + body + end
    if rng.random() < 0.4:
        out += questions(rng, c)
    return " ".join(out)


# ---------------------------------------------------------------------------------------------
# Other document kinds: lessons, letters, diaries
# ---------------------------------------------------------------------------------------------


def arithmetic_lesson(rng: random.Random) -> str:
    out = [rng.choice(["Let us practice adding and taking away.", "Here are some sums to learn.",
                       "Today we learn about numbers."])]
    start = rng.randint(1, 20)
    n = rng.randint(4, 9)
    out.append("Count with me: " + ", ".join(words(k) for k in range(start, start + n)) + ".")
    for _ in range(rng.randint(4, 8)):
        op = rng.randrange(4)
        if op == 0:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            out.append(f"{cap(words(a))} plus {words(b)} is {words(a + b)}.")
        elif op == 1:
            a = rng.randint(1, 20)
            b = rng.randint(0, a)
            out.append(f"{cap(words(a))} minus {words(b)} is {words(a - b)}.")
        elif op == 2:
            a, b = rng.randint(1, 10), rng.randint(1, 10)
            out.append(f"{cap(words(a))} times {words(b)} is {words(a * b)}.")
        else:
            a = rng.randint(1, 99)
            out.append(f"The number after {words(a)} is {words(a + 1)}.")
    name = rng.choice(GIRL_NAMES + BOY_NAMES)
    noun = rng.choice(FOODS + THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    out.append(f"If {name} has {count(a, noun)} and finds {words(b)} more, "
               f"{name} has {count(a + b, noun)}.")
    return " ".join(out)


def calendar_lesson(rng: random.Random) -> str:
    out = []
    if rng.random() < 0.5:
        out.append("There are seven days in a week: " + join_list(DAYS) + ".")
    for _ in range(rng.randint(2, 5)):
        i = rng.randrange(7)
        out.append(rng.choice([
            f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.",
            f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.",
            f"{DAYS[i]} is the {ORDINALS[i]} day of the week.",
            f"If today is {DAYS[i]}, then tomorrow is {DAYS[(i + 1) % 7]} and yesterday was {DAYS[(i - 1) % 7]}.",
        ]))
    if rng.random() < 0.6:
        out.append("There are four seasons: " + join_list(SEASONS) + ".")
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(4)
            s = SEASONS[i]
            out.append(rng.choice([
                f"After {s} comes {SEASONS[(i + 1) % 4]}.",
                f"Before {s} comes {SEASONS[(i - 1) % 4]}.",
                f"In {s}, {rng.choice(SEASON_FACTS[s])}.",
                f"In {s}, people like to {rng.choice(SEASON_ACTIVITIES[s])}.",
            ]))
    return " ".join(out)


def letter(rng: random.Random) -> str:
    hero = make_character(rng)
    friend = make_character(rng, avoid=(hero.name,))
    day = rng.randrange(7)
    place, acts = rng.choice(PLACES)
    s = rng.choice(SEASONS)
    noun = (hero.food[0], hero.food[1])
    n = rng.randint(2, 9)
    out = [
        f"Dear {friend.name},",
        f"Today is {DAYS[day]} and it is {s} here in {hero.town}.",
        f"In {s}, {rng.choice(SEASON_FACTS[s])}.",
        f"Yesterday was {DAYS[(day - 1) % 7]}. I went to {place} and {rng.choice(acts)}.",
        f"My {hero.pet[0]}, {hero.pet_name}, {rng.choice(hero.pet[3])}.",
        f"My {hero.parent} gave me {count(n, noun)}, and I ate {words(1)}, so now I have {count(n - 1, noun)}.",
        f"Tomorrow is {DAYS[(day + 1) % 7]}. I hope you can come and visit.",
        f"Your friend, {hero.name}",
    ]
    return " ".join(out)


def diary(rng: random.Random) -> str:
    hero = make_character(rng)
    start = rng.randrange(7)
    out = [f"The diary of {hero.name}, age {words(hero.age)}.",
           f"I have a {hero.pet[0]}. {cap(PRONOUNS['girl' if rng.random() < 0.5 else 'boy'][0])} is called "
           f"{hero.pet_name}."]
    for k in range(rng.randint(3, 5)):
        place, acts = rng.choice(PLACES)
        kind, _ = rng.choice(WEATHER)
        out.append(f"{DAYS[(start + k) % 7]}. The weather was {kind}. I went to {place} and {rng.choice(acts)}.")
        if rng.random() < 0.4:
            out.append(f"{hero.pet_name} {rng.choice(hero.pet[3])}.")
    out.append(f"I like this week. I feel {rng.choice(FEELINGS)}.")
    return " ".join(out)


# Document kinds with their share of the corpus; stories carry most of the structure.
KINDS = [(story, 0.70), (arithmetic_lesson, 0.10), (calendar_lesson, 0.07), (letter, 0.07), (diary, 0.06)]


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> list[str]:
    """Documents, in order, until their total size (with newlines) reaches ``target_bytes``."""
    rng = random.Random(seed)
    makers = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    docs, size = [], 0
    while True:
        doc = rng.choices(makers, weights)[0](rng)
        assert "\n" not in doc
        n = len(doc.encode("utf-8")) + 1
        if size + n > target_bytes:
            return docs
        docs.append(doc)
        size += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--bytes", type=int, default=TARGET_BYTES, help="approximate output size")
    args = parser.parse_args()

    docs = generate(args.seed, args.bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" so the bytes are the same on every platform.
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        for doc in docs:
            fh.write(doc + "\n")
    n_words = sum(len(d.split()) for d in docs)
    print(f"wrote {args.out}: {len(docs)} documents, {n_words} words, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
