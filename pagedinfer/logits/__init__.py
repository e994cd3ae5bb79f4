"""Everything that shapes a step's logits rows before a token is drawn: one seam (`processor`), the logit
controls (`controls`: penalties, min_tokens, logit_bias, bad_words, allowed_token_ids) and structured
outputs (`structured`: grammars compiled by llguidance, one matcher per sequence)."""
