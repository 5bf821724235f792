"""What the router's decisions cost: the cost model and the prices measured while serving.

    cost.py              CostModel: queue, prefill, decode-step and K/V transfer seconds
    calibration.py       where the cost model comes from: a `pdserve profile` file or a fit at start
    tp_pricing.py        the cost model at the deployment's tensor-parallel sizes
    live_collectives.py  a served TP worker's collectives priced from its rank 0's own steps
    kv_rates.py          live K/V placement rates (fetch, host tier) for the cost model
    decode_clocks.py     the decode workers' token clocks and the arrival rate the P/D decision reads
"""
