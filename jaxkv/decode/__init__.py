"""The functional decode loop: decoder, state, set-up, in-step admission, sampling, sharding.

decoder   `Decoder`: prefill, decode_step / window_step, generate, score
state     `DecodeState` and how a step updates it; `summarize`
setup     what the decoder settles on the host before anything is traced
follow    the in-step admission rule (a `follow` policy, `lrfu`), applied after the layers
sampling  token samplers (`Greedy`, `Sampling`)
sharded   `ShardedDecoder`: the cache and loop on a ("data", "model") mesh
"""
