"""Following a stored tokenization (``respell``): the walk over stored blocks.

The real DeepSeek tokenizer; the stored blocks are given as the store's answer
would give them (key, parent, token ids). What a user would notice: the prompt's
text never changes, turn markers stay markers, characters stay whole, and the
prompt's own ids are kept after the followed blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from dscache_server.kvstore import StoredBlock
from dscache_server.respell import Spelling
from dscache_server.tokenizer import USER, DeepSeekTokenizer
from dscache_tools.bench.respell import spelled_apart

B = 8  # tokens per block in these tests


@pytest.fixture(scope="module")
def spelling(tokenizer: DeepSeekTokenizer) -> Spelling:
    return Spelling(tokenizer.backend)


class Tree:
    """Stored blocks as the store lists them: each block keyed by its parent's key
    and its ids, under a given first parent."""

    def __init__(self, parent: bytes, ids: Sequence[int]) -> None:
        self.blocks: list[StoredBlock] = []
        for i in range(len(ids) // B):
            block = list(ids[i * B : (i + 1) * B])
            key = hashlib.blake2b(parent + str(block).encode(), digest_size=32).digest()
            self.blocks.append(StoredBlock(key, parent, block))
            parent = key
        self.asked: list[bytes] = []

    def below(self, key: bytes, firsts: Sequence[int]) -> tuple[list[StoredBlock], bool]:
        self.asked.append(key)
        assert firsts, "the store is told which first tokens can spell the prompt"
        return self.blocks, False


def test_stored_blocks_are_followed_and_the_prompt_keeps_its_own_ids_after_them(
    spelling: Spelling, tokenizer: DeepSeekTokenizer
) -> None:
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"
    prompt = tokenizer.encode(text)
    stored = [*prompt[:B], *spelled_apart(tokenizer, prompt[B:12], 0, 12 - B)]  # 2 blocks and a bit
    assert tokenizer.decode(stored) == tokenizer.decode(prompt[:12])
    tree = Tree(b"p" * 32, stored[B:])
    ids, followed = spelling.follow(prompt, B, b"p" * 32, tree.below, tokenizer.encode)
    assert followed == len(tree.blocks) * B > 0
    assert ids[B : B + followed] == stored[B : B + followed]
    assert tokenizer.decode(ids) == text  # the same text, whatever the split
    # After the followed blocks: a short bridge, then the prompt's own ids.
    assert ids[-(len(prompt) - 12) :] == prompt[12:]
    assert spelling.spell(ids) == spelling.spell(prompt)


def test_nothing_stored_below_or_nothing_that_spells_the_prompt_changes_nothing(
    spelling: Spelling, tokenizer: DeepSeekTokenizer
) -> None:
    prompt = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    empty = Tree(b"p" * 32, [])
    assert spelling.follow(prompt, B, b"p" * 32, empty.below, tokenizer.encode) == (prompt, 0)
    different = tokenizer.encode("a different text altogether")
    other = Tree(b"p" * 32, spelled_apart(tokenizer, different, 0, len(different)))
    assert spelling.follow(prompt, B, b"p" * 32, other.below, tokenizer.encode) == (prompt, 0)
    # Ids no tokenizer of this model has (another model's, a damaged index): no match.
    alien = Tree(b"p" * 32, [tokenizer.vocab_size + 5] * B)
    assert spelling.follow(prompt, B, b"p" * 32, alien.below, tokenizer.encode) == (prompt, 0)


def test_a_turn_marker_is_never_matched_by_text_that_spells_it(
    spelling: Spelling, tokenizer: DeepSeekTokenizer
) -> None:
    """A model may generate the characters of a turn marker as plain tokens; the
    template encodes the marker itself. The two must not pass for each other."""
    head = tokenizer.encode("question one two three four five six seven")[:B]
    prompt = [*head, tokenizer.user_id, *tokenizer.encode(" and then more words follow here")]
    plain = [t for ch in USER for t in tokenizer.encode(ch)]  # the marker's text, spelled
    assert tokenizer.user_id not in plain
    tree = Tree(b"p" * 32, [*plain, *tokenizer.encode(" and then more words follow here")])
    assert spelling.follow(prompt, B, b"p" * 32, tree.below, tokenizer.encode) == (prompt, 0)


def test_a_character_split_across_blocks_is_not_cut(
    spelling: Spelling, tokenizer: DeepSeekTokenizer
) -> None:
    """A stored block may end inside a character (byte-level tokens): the walk stops
    before that block, so the rest of the prompt starts on a whole character."""
    text = "abcdefgh" + "数据" * 8 + " tail words"
    prompt = tokenizer.encode(text)
    start = len(tokenizer.encode("abcdefgh"))
    assert start <= B
    # The characters as single bytes: 3 tokens per character, so blocks of 8 cut them.
    bytes_of = spelling.spell(prompt[start:])
    table = {
        spelling.spell([i]): i for i in range(tokenizer.vocab_size) if len(spelling.spell([i])) == 1
    }
    stored = [table[bytes([b])] for b in bytes_of[:40]]  # 5 blocks: 13 characters and a third
    tree = Tree(b"p" * 32, stored)
    ids, followed = spelling.follow(prompt, start, b"p" * 32, tree.below, tokenizer.encode)
    assert followed == 24  # 3 blocks: 8 characters; the 4th and 5th end inside one
    assert tokenizer.decode(ids) == text
    assert "\ufffd" not in tokenizer.decode(ids[start + followed :])
