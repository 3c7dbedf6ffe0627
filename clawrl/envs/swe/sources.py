'''The correct source of each SWE project template (clawrl/envs/swe/templates.py says how
they are filled and tested). Each is one module: constants at the top, then functions with
docstrings that say what is right, so an agent can tell the seeded bug from the intent.'''

TEXT = '''"""Small text utilities: counting, cutting, joining and padding words."""

SEPARATOR = $sep
ELLIPSIS = $ellipsis
VOWELS = "aeiou"


def word_count(text):
    """The number of words in text (runs of characters between whitespace)."""
    return len(text.split())


def truncate(text, width):
    """text cut to at most width characters; a text that was cut ends with ELLIPSIS."""
    if len(text) <= width:
        return text
    return text[: width - len(ELLIPSIS)] + ELLIPSIS


def join_words(words):
    """The words that are not blank, stripped, joined with SEPARATOR."""
    kept = []
    for word in words:
        if word.strip():
            kept.append(word.strip())
    return SEPARATOR.join(kept)


def title_words(text, shortest):
    """text with the first letter of each word of at least shortest letters upper-cased."""
    out = []
    for word in text.split(" "):
        if len(word) >= shortest:
            word = word[0].upper() + word[1:]
        out.append(word)
    return " ".join(out)


def count_vowels(text):
    """How many letters of text are vowels, in any case."""
    total = 0
    for ch in text.lower():
        if ch in VOWELS:
            total += 1
    return total


def pad_right(text, width, fill):
    """text padded on the right with fill up to width characters (a longer text is kept)."""
    missing = width - len(text)
    if missing <= 0:
        return text
    return text + fill * missing


def frame(text, width, fill):
    """text padded on the right with fill to width characters, between two '|'."""
    return "|" + pad_right(text, width, fill) + "|"


def censor(text, word):
    """text with every occurrence of word replaced by as many '*' as it has letters."""
    if not word:
        return text
    return text.replace(word, "*" * len(word))


def initials(name, limit):
    """The upper-cased first letters of the first limit words of name, each followed by '.'."""
    letters = [part[0].upper() + "." for part in name.split()]
    return "".join(letters[:limit])
'''

STOCK = '''"""Counts of items in stock, with a restock rule."""

LOW_STOCK = $low
MAX_STOCK = $max


class $Cls:
    """Counts of items by name."""

    def __init__(self, counts):
        self.counts = dict(counts)

    def add(self, item, amount):
        """Add amount of item, capped at MAX_STOCK; the new count. ValueError when amount < 0."""
        if amount < 0:
            raise ValueError("amount must not be negative")
        new = self.counts.get(item, 0) + amount
        self.counts[item] = min(new, MAX_STOCK)
        return self.counts[item]

    def remove(self, item, amount):
        """Take amount of item away; the new count. KeyError for an item never stocked,
        ValueError when fewer than amount are left."""
        if item not in self.counts:
            raise KeyError(item)
        if self.counts[item] < amount:
            raise ValueError("not enough " + item)
        self.counts[item] -= amount
        return self.counts[item]

    def total(self):
        """How many items there are, all names together."""
        total = 0
        for count in self.counts.values():
            total += count
        return total

    def low_stock(self):
        """The names of the items with fewer than LOW_STOCK left, sorted."""
        return sorted(name for name, count in self.counts.items() if count < LOW_STOCK)

    def restock_order(self, target):
        """How many of each low item to order to have target of it: a dict without zeros."""
        order = {}
        for name in self.low_stock():
            need = target - self.counts[name]
            if need > 0:
                order[name] = need
        return order

    def value(self, prices):
        """What the stock is worth: each count times its price; an item without a price is 0."""
        return sum(count * prices.get(name, 0) for name, count in self.counts.items())

    def transfer(self, other, item, amount):
        """Move amount of item from this stock to other; (the count left here, the count there)."""
        left = self.remove(item, amount)
        there = other.add(item, amount)
        return left, there
'''

GRID = '''"""Helpers for grids: lists of equally long rows of numbers, (row, column) from 0."""

EMPTY = $empty


def make_grid(rows, cols):
    """A grid of rows x cols cells, each EMPTY."""
    return [[EMPTY] * cols for _ in range(rows)]


def transpose(grid):
    """The grid's columns as rows."""
    if not grid:
        return []
    return [[grid[r][c] for r in range(len(grid))] for c in range(len(grid[0]))]


def row_sums(grid):
    """The sum of each row."""
    return [sum(row) for row in grid]


def column_sum(grid, c):
    """The sum of column c."""
    total = 0
    for row in grid:
        total += row[c]
    return total


def neighbors(grid, r, c):
    """The values of the cells next to (r, c) inside the grid: above, below, left, right."""
    found = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        nr, nc = r + dr, c + dc
        if 0 <= nr < len(grid) and 0 <= nc < len(grid[0]):
            found.append(grid[nr][nc])
    return found


def count_above(grid, threshold):
    """How many cells hold more than threshold."""
    count = 0
    for row in grid:
        for value in row:
            if value > threshold:
                count += 1
    return count


def get_cell(grid, r, c):
    """The value at (r, c), or EMPTY for a cell outside the grid."""
    if r < 0 or c < 0:
        return EMPTY
    if r >= len(grid) or c >= len(grid[r]):
        return EMPTY
    return grid[r][c]


def corners(grid):
    """The four corner values: top left, top right, bottom left, bottom right."""
    last_r, last_c = len(grid) - 1, len(grid[0]) - 1
    return [get_cell(grid, 0, 0), get_cell(grid, 0, last_c), get_cell(grid, last_r, 0),
            get_cell(grid, last_r, last_c)]


def shift_row(row, steps):
    """row rotated steps places to the right."""
    if not row:
        return []
    steps = steps % len(row)
    return row[len(row) - steps:] + row[:len(row) - steps]


def window_sums(row, size):
    """The sums of each run of size neighbouring values in row, left to right."""
    return [sum(row[i:i + size]) for i in range(0, len(row) - size + 1)]


def scale(grid, factor):
    """Each cell multiplied by factor."""
    return [[value * factor for value in row] for row in grid]
'''

SETTINGS = '''"""A parser for settings text: one 'key ASSIGN value' per line, comments after COMMENT."""

COMMENT = $comment
ASSIGN = $assign
TRUE_WORDS = ("true", "yes", "on")


def strip_comment(line):
    """line without its comment and the blanks around it."""
    index = line.find(COMMENT)
    if index >= 0:
        line = line[:index]
    return line.strip()


def parse_value(text):
    """text as a bool (TRUE_WORDS, or false/no/off, any case), an int (digits, maybe after
    one '-'), else the text itself."""
    lowered = text.lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in ("false", "no", "off"):
        return False
    if text.startswith("-") and text[1:].isdigit():
        return -int(text[1:])
    if text.isdigit():
        return int(text)
    return text


def parse_line(line):
    """(key, value) of a settings line, the key lower-cased; None for a blank or comment
    line; ValueError for a line without ASSIGN."""
    line = strip_comment(line)
    if not line:
        return None
    if ASSIGN not in line:
        raise ValueError("no " + ASSIGN + " in " + line)
    key, value = line.split(ASSIGN, 1)
    return key.strip().lower(), parse_value(value.strip())


def parse_text(text):
    """The settings of a whole text as a dict; when a key comes twice, the later one wins."""
    settings = {}
    for line in text.splitlines():
        pair = parse_line(line)
        if pair is not None:
            settings[pair[0]] = pair[1]
    return settings


def parse_list(text, sep):
    """The items of text split at sep, stripped, the empty ones left out."""
    return [item.strip() for item in text.split(sep) if item.strip()]


def count_prefixed(text, prefix):
    """How many distinct keys of text start with prefix."""
    count = 0
    for key in parse_text(text):
        if key.startswith(prefix):
            count += 1
    return count


def render(settings):
    """settings as text, one 'key ASSIGN value' line per key, sorted by key."""
    lines = []
    for key in sorted(settings):
        lines.append(key + " " + ASSIGN + " " + str(settings[key]))
    return "\\n".join(lines)


def get_setting(text, key, default):
    """The value of key (any case) in text, or default when it is not set."""
    settings = parse_text(text)
    return settings.get(key.lower(), default)
'''

SPANS = '''"""Helpers for time spans: (start, end) minutes since midnight, the end minute excluded."""

SLOT = $slot
HOUR = 60


def duration(span):
    """The span's length in minutes."""
    start, end = span
    return end - start


def overlaps(a, b):
    """Whether spans a and b share at least one minute."""
    return a[0] < b[1] and b[0] < a[1]


def merge(spans):
    """The spans merged where they overlap or touch, sorted by start."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def to_clock(minute):
    """The minute as an 'HH:MM' clock text."""
    hours, minutes = divmod(minute, HOUR)
    return str(hours).zfill(2) + ":" + str(minutes).zfill(2)


def round_up(minute):
    """The first SLOT boundary at or after minute."""
    remainder = minute % SLOT
    if remainder == 0:
        return minute
    return minute + SLOT - remainder


def free_time(busy, start, end):
    """The spans between start and end that no busy span covers, in order."""
    free = []
    cursor = start
    for b_start, b_end in merge(busy):
        if b_start > cursor:
            free.append((cursor, min(b_start, end)))
        cursor = max(cursor, b_end)
    if cursor < end:
        free.append((cursor, end))
    return [span for span in free if span[0] < span[1]]


def busy_minutes(busy, start, end):
    """How many minutes between start and end some busy span covers."""
    return (end - start) - sum(duration(span) for span in free_time(busy, start, end))


def clamp(span, low, high):
    """The span cut to lie between low and high."""
    return (max(span[0], low), min(span[1], high))


def slots(span):
    """How many whole SLOT-minute slots fit in the span."""
    return duration(span) // SLOT
'''
