"""A selector inside your own decoding loop (the README example, runnable as written)."""

import torch

from specselect import TetrisSelector

torch.manual_seed(0)
selector = TetrisSelector(k=3, extra=2)  # drafts 5 tokens, verifies 3 per request on average
active = torch.ones(8, dtype=torch.bool)  # 8 requests in the batch
for step in range(4):
    window = selector.draft_length(num_active=int(active.sum()))  # tokens to draft per request
    draft_logprobs = torch.rand(8, window).log()  # log q of each drafted token, from your draft
    selection = selector.select(draft_logprobs, active)  # lengths [8], prefix mask [8, window]
    # ... verify the selected tokens with your target; count accepted tokens per request ...
    num_accepted = torch.minimum(selection.lengths, torch.randint(0, window + 1, (8,)))
    selector.update(selection, num_accepted)
    # the same counts on the host, one per active row, from the read-back your loop makes
    # anyway, and which rows they are (DSD, the goodput budget and the heuristic plan from them)
    verified, accepted = selection.lengths[active].tolist(), num_accepted[active].tolist()
    selector.observe(verified, accepted, active=active.tolist())
    active[step] = False  # a request finishes: its row stays, inactive
    print(selection.lengths.tolist(), "verified", int(selection.num_verified))
