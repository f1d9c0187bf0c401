"""Brute-force expectations for the n-gram drafters' voted trie (tests/drafters)."""


def voted_trie(ranked, k: int, s: int, n_nodes: int) -> list:
    """The n_nodes-1 node paths the 4k best matches vote for. ranked: [(n, continuation)], best match first;
    each adds 2^n to every node of its continuation's first s tokens; ties go to the better match, then the
    shallower node."""
    votes, first = {}, {}
    for r, (n, cont) in enumerate(ranked[:4 * k]):
        cont = cont[:s]
        for d in range(1, len(cont) + 1):
            votes[tuple(cont[:d])] = votes.get(tuple(cont[:d]), 0) + 2 ** n
            first.setdefault(tuple(cont[:d]), r)
    return sorted(votes, key=lambda p: (-votes[p], first[p], len(p)))[:n_nodes - 1]


def linked_paths(tokens: list, parent: list, n_nodes: int) -> list:
    """The root-to-node token path of every linked node 1..n_nodes-1, in node order."""
    got = []
    for j in range(1, n_nodes):
        path, v = [], j
        while v > 0:
            path.append(tokens[v])
            v = parent[v]
        if parent[j] >= 0:
            got.append(tuple(reversed(path)))
    return got
