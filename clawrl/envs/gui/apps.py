"""The GUI track's application templates: from a random generator and a goal kind, one small
web application's spec (what clawrl/envs/gui/app.js renders), its goal in words, the check
of its state that says the goal is met, and two plans the generator knows — the solution
and a decoy (the same kind of move on the wrong control, or a wrong value) that must fail.

A plan is a list of steps by role and name, as the agent reads the page, never by id:
("click", role, name), ("type", role, name, text), ("press", key), ("done",). A check is
(field of the state, "equals" | "includes", value): `includes` means every key of value has
that value in the field (a form's submission); `equals` the whole field.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Step = tuple[str, ...]


@dataclass(frozen=True)
class App:
    spec: dict[str, Any]  # window.SPEC: template, title, layout, the controls, the state
    goal: str             # the goal in words, e.g. "Turn on dark mode."
    check: tuple[str, str, Any]
    plan: list[Step]      # the known solution
    decoy: list[Step]     # a wrong attempt of the same kind


LAYOUTS = ("list", "grid", "wide")
NUMBERS = ("one", "two", "three")

TOGGLES = [("dark_mode", "Dark mode"), ("notifications", "Notifications"),
           ("autoplay", "Autoplay videos"), ("location", "Location access"),
           ("two_factor", "Two-factor login"), ("digest", "Weekly email digest"),
           ("compact", "Compact view"), ("sounds", "Sound effects"),
           ("auto_update", "Automatic updates"), ("avatars", "Show avatars"),
           ("spellcheck", "Spell check"), ("read_receipts", "Read receipts")]
CHOICES = [("language", "Language", ["English", "French", "German", "Spanish", "Italian"]),
           ("theme", "Theme", ["Light", "Dark", "System"]),
           ("font_size", "Font size", ["Small", "Medium", "Large", "Huge"]),
           ("currency", "Currency", ["Euro", "Dollar", "Pound", "Yen"]),
           ("start_page", "Start page", ["Home", "Inbox", "Calendar", "Files"]),
           ("units", "Units", ["Metric", "Imperial", "Nautical"]),
           ("timezone", "Time zone", ["London", "Paris", "New York", "Tokyo", "Sydney"])]
FORM_CHOICES = [("country", "Country", ["France", "Kenya", "Peru", "Japan", "Norway"]),
                ("plan", "Plan", ["Free", "Basic", "Pro", "Team"]),
                ("size", "T-shirt size", ["S", "M", "L", "XL"]),
                ("contact", "Contact by", ["Email", "Phone", "Letter"])]
FIRST = ["Ada", "Alan", "Grace", "Linus", "Marie", "Nikola", "Rosalind", "Tim", "Edsger",
         "Barbara", "Katherine", "Dennis", "Hedy", "Claude"]
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Perth", "Cork", "Kyoto"]
LINKS = ["Home", "Pricing", "Blog", "About", "Careers", "Docs", "News", "Shop"]
MENUS = {"Account": ["Profile", "Security", "Sessions"], "Billing": ["Invoices", "Payments",
         "Plans"], "Help": ["Contact", "FAQ", "Status"], "Projects": ["Active", "Archived",
         "Templates"], "Reports": ["Sales", "Traffic", "Exports"], "Team": ["Members", "Roles",
         "Invitations"]}
PRODUCTS = [("apple", "apple", "Apples"), ("pear", "pear", "Pears"),
            ("banana", "banana", "Bananas"), ("orange", "orange", "Oranges"),
            ("plum", "plum", "Plums"), ("lemon", "lemon", "Lemons"), ("mango", "mango", "Mangos"),
            ("kiwi", "kiwi", "Kiwis"), ("cherry", "cherry", "Cherries"),
            ("peach", "peach", "Peaches"), ("fig", "fig", "Figs"), ("lime", "lime", "Limes")]
STARS = ["Orion", "Vega", "Lyra", "Atlas", "Nova", "Polaris", "Sirius", "Draco", "Hydra",
         "Phoenix", "Cygnus", "Rigel", "Altair", "Deneb"]
COLLECTIONS = [("Projects", "project"), ("Boards", "board"), ("Playlists", "playlist"),
               ("Folders", "folder"), ("Reports", "report")]


def _lower(label: str) -> str:
    return label[0].lower() + label[1:]


def _price(rng: random.Random) -> str:
    return f"€{rng.randint(1, 9)}.{rng.choice(['00', '20', '50', '90'])}"


def settings(rng: random.Random, kind: str) -> App:
    toggles = rng.sample(TOGGLES, rng.randint(2, 5))
    choices = rng.sample(CHOICES, rng.randint(1 if kind == "choose" else 0, 3))
    controls: list[dict[str, Any]] = [{"key": k, "label": label, "type": "toggle"}
                                      for k, label in toggles]
    controls += [{"key": k, "label": label, "type": "choice", "options": rng.sample(opts,
                  len(opts))} for k, label, opts in choices]
    rng.shuffle(controls)
    values = {c["key"]: rng.random() < 0.5 if c["type"] == "toggle" else rng.choice(c["options"])
              for c in controls}
    save = rng.choice([None, "Save", "Save changes", "Apply"])
    spec = {"template": "settings", "title": rng.choice(["Settings", "Preferences",
            "Account settings", "App options"]), "layout": rng.choice(LAYOUTS),
            "controls": controls, "save": save,
            "state": {"values": values, "saved": dict(values), "status": ""}}
    tail: list[Step] = [("click", "button", save), ("done",)] if save else [("done",)]
    if kind == "toggle":
        target, other = rng.sample([c for c in controls if c["type"] == "toggle"], 2)
        on = not values[target["key"]]
        verb = rng.choice(["Turn on", "Enable", "Switch on"] if on
                          else ["Turn off", "Disable", "Switch off"])
        goal = f"{verb} {_lower(target['label'])}."
        plan: list[Step] = [("click", "switch", target["label"])]
        decoy: list[Step] = [("click", "switch", other["label"])]
        want: Any = on
    else:
        target = rng.choice([c for c in controls if c["type"] == "choice"])
        opts = [o for o in target["options"] if o != values[target["key"]]]
        want, wrong = rng.sample(opts, 2) if len(opts) > 1 else (opts[0], values[target["key"]])
        goal = rng.choice([f"Set the {_lower(target['label'])} to {want}.",
                           f"Change the {_lower(target['label'])} to {want}."])
        plan = [("click", "combobox", target["label"]), ("click", "option", str(want))]
        decoy = [("click", "combobox", target["label"]), ("click", "option", str(wrong))]
    return App(spec, goal, ("saved", "equals", {**values, target["key"]: want}),
               plan + tail, decoy + tail)


def form(rng: random.Random, kind: str) -> App:
    first = rng.choice(FIRST)
    name_label = rng.choice(["Name", "First name", "Your name"])
    pool: list[dict[str, Any]] = [{"key": "age", "label": "Age", "type": "number", "min": 18, "max": 99,
             "value": str(rng.randint(18, 99))},
            {"key": "email", "label": rng.choice(["Email", "Email address"]), "type": "email",
             "value": f"{first.lower()}{rng.randint(1, 99)}@example.org"},
            {"key": "city", "label": "City", "type": "text", "value": rng.choice(CITIES)}]
    fields: list[dict[str, Any]] = [{"key": "name", "label": name_label, "type": "text", "value": first}]
    fields += rng.sample(pool, rng.randint(1, 2) if kind == "choose" else rng.randint(1, 3))
    if kind == "choose":
        key, label, opts = rng.choice(FORM_CHOICES)
        fields.append({"key": key, "label": label, "type": "choice",
                       "options": rng.sample(opts, len(opts)), "value": rng.choice(opts)})
    rng.shuffle(fields)
    asked = [f for f in fields if f["key"] == "name" or f["type"] == "choice"
             or rng.random() < 0.7]
    for f in fields:
        f["required"] = f in asked
    spec_fields = [{k: v for k, v in f.items() if k != "value"} for f in fields]
    parts = [f"{_lower(f['label'])} {f['value']}" for f in asked]
    said = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
    goal = rng.choice([f"Send the form with {said}.", f"Fill in the form with {said} and send it."])
    submit = rng.choice(["Send", "Submit", "Sign up", "Register", "Continue"])
    plan: list[Step] = []
    for f in asked:
        plan += ([("click", "combobox", f["label"]), ("click", "option", f["value"])]
                 if f["type"] == "choice" else [("type", "textbox", f["label"], f["value"])])
    decoy = list(plan)
    wrong = next(i for i, s in enumerate(decoy) if s[0] == "type")
    decoy[wrong] = (*decoy[wrong][:3], decoy[wrong][3] + "x" if decoy[wrong][2] != "Age"
                    else str(int(decoy[wrong][3]) % 80 + 19))
    enter = plan[-1][0] == "type" and rng.random() < 0.5  # Enter in the last field sends it
    send: list[Step] = [("press", "Enter")] if enter else [("click", "button", submit)]
    spec = {"template": "form", "title": rng.choice(["Sign up", "Contact us", "Join the club",
            "Register", "Newsletter"]), "layout": rng.choice(LAYOUTS), "fields": spec_fields,
            "submit": submit, "thanks": rng.choice(["Thank you, your form was sent.",
                                                    "Thanks! We got your details."]),
            "state": {"values": {f["key"]: "" for f in fields}, "errors": {},
                      "submitted": None, "attempts": 0}}
    return App(spec, goal, ("submitted", "includes", {f["key"]: f["value"] for f in asked}),
               plan + send + [("done",)], decoy + send + [("done",)])


def menu(rng: random.Random, kind: str) -> App:
    links = ["Home", *rng.sample(LINKS[1:], rng.randint(2, 4))]
    names = rng.sample(sorted(MENUS), rng.randint(1 if kind == "choose" else 0, 3))
    menus: list[dict[str, Any]] = [{"label": label, "page": label.lower()} for label in links]
    menus += [{"label": m, "items": [{"label": i, "page": i.lower()} for i in
                                     rng.sample(MENUS[m], rng.randint(2, 3))]} for m in names]
    rng.shuffle(menus)
    pages = {m["page"]: m["label"] for m in menus if "page" in m}
    pages |= {i["page"]: i["label"] for m in menus for i in m.get("items", [])}
    blurb = ["Welcome to the {} page.", "This is {}.", "You are on {}."]
    spec = {"template": "menu", "title": rng.choice(["Acme", "Northwind", "Globex", "Initech"]),
            "layout": rng.choice(LAYOUTS), "menus": menus,
            "pages": {p: {"title": label, "text": rng.choice(blurb).format(label)}
                      for p, label in pages.items()},
            "state": {"page": "home", "visits": []}}
    if kind == "navigate":
        target, other = rng.sample(links[1:], 2)
        goal = rng.choice([f"Open the {target} page.", f"Go to the {target} page."])
        plan: list[Step] = [("click", "link", target)]
        decoy: list[Step] = [("click", "link", other)]
    else:
        group = rng.choice([m for m in menus if "items" in m])
        target, other = [i["label"] for i in rng.sample(group["items"], 2)]
        goal = rng.choice([f"Open the {target} page from the {group['label']} menu.",
                           f"Go to {group['label']} > {target}."])
        plan = [("click", "button", group["label"]), ("click", "menuitem", target)]
        decoy = [("click", "button", group["label"]), ("click", "menuitem", other)]
    return App(spec, goal, ("page", "equals", target.lower()), plan + [("done",)],
               decoy + [("done",)])


def basket(rng: random.Random, kind: str) -> App:
    products = rng.sample(PRODUCTS, rng.randint(3, 6))
    held = rng.sample(products, rng.randint(2, 3) if kind == "remove" else rng.randint(0, 2))
    start = {key: rng.randint(1, 3) for key, _, _ in held}
    spec = {"template": "basket", "title": rng.choice(["Green grocer", "Fruit market",
            "Corner shop", "Orchard store"]), "layout": rng.choice(LAYOUTS),
            "products": [{"key": k, "name": plural, "price": _price(rng)}
                         for k, _, plural in products],
            "state": {"basket": start}}
    if kind == "add":
        key, one, plural = rng.choice(products)
        n = rng.randint(1, 3)
        what = f"{NUMBERS[n - 1]} {one if n == 1 else plural.lower()}"
        goal = rng.choice([f"Add {what} to the basket.", f"Put {what} in the basket."])
        target = {**start, key: start.get(key, 0) + n}
        plan: list[Step] = [("click", "button", f"Add {plural}")] * n
        decoy: list[Step] = [("click", "button", f"Add {plural}")] * (n + 1)
    else:
        (key, _, plural), (_, _, other) = rng.sample(held, 2)
        goal = rng.choice([f"Remove the {plural.lower()} from the basket.",
                           f"Take the {plural.lower()} out of the basket."])
        target = {k: v for k, v in start.items() if k != key}
        plan = [("click", "button", f"Remove {plural}")]
        decoy = [("click", "button", f"Remove {other}")]
    return App(spec, goal, ("basket", "equals", target), plan + [("done",)], decoy + [("done",)])


def dialog(rng: random.Random, kind: str) -> App:
    title, noun = rng.choice(COLLECTIONS)
    names = rng.sample(STARS, rng.randint(3, 6))
    items, spare = names[:-1], names[-1]
    confirm = rng.choice(["Delete", "Yes, delete", "Remove", "Confirm"])
    cancel = rng.choice(["Cancel", "Keep it", "Go back"])
    spec = {"template": "dialog", "title": title, "layout": rng.choice(LAYOUTS),
            "confirm": confirm, "cancel": cancel,
            "warning": rng.choice(["This cannot be undone.", f"The {noun} will be gone for good."]),
            "state": {"items": list(items), "dialog": None, "log": []}}
    target, other = rng.sample(items, 2)
    if kind == "confirm":
        goal = rng.choice([f"Delete the {noun} {target}.", f"Remove the {noun} {target}."])
        plan: list[Step] = [("click", "button", f"Delete {target}"), ("click", "button", confirm)]
        decoy: list[Step] = [("click", "button", f"Delete {target}"), ("click", "button", cancel)]
        want = [i for i in items if i != target]
    else:
        goal = f"Rename the {noun} {target} to {spare}."
        plan = [("click", "button", f"Rename {target}"), ("type", "textbox", "New name", spare),
                ("click", "button", "Save")]
        decoy = [("click", "button", f"Rename {other}"), ("type", "textbox", "New name", spare),
                 ("click", "button", "Save")]
        want = [spare if i == target else i for i in items]
    return App(spec, goal, ("items", "equals", want), plan + [("done",)], decoy + [("done",)])


TEMPLATES: dict[str, tuple[Callable[[random.Random, str], App], tuple[str, ...]]] = {
    "settings": (settings, ("toggle", "choose")),
    "form": (form, ("fill", "choose")),
    "menu": (menu, ("navigate", "choose")),
    "basket": (basket, ("add", "remove")),
    "dialog": (dialog, ("confirm", "rename")),
}


def goal_met(check: tuple[str, str, Any], state: dict[str, Any] | None) -> bool:
    """Whether the application's state meets the check (see the module docstring)."""
    if not isinstance(state, dict):
        return False
    field, mode, want = check
    got = state.get(field)
    if mode == "includes":
        return isinstance(got, dict) and all(got.get(k) == v for k, v in want.items())
    return bool(got == want)
