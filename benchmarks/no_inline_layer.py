"""A decoder layer compiled once (``mindspore.no_inline``) against the unrolled stack, on the CPU.

The layer is written as a pure function of (hidden states, rotary tables, mask, its weights):
Qwen2.5-0.5B's dimensions (H 896, 14 heads / 2 KV heads, I 4864), LoRA r 8 on q and v (frozen
weights behind ``ops.stop_gradient``), batch 1 x 512, fp32, CPU graph-kernel fusion on, AdamW over
the LoRA factors. Each layer Cell calls the same function with its own weights; with
``no_inline`` the graph holds one copy of the layer's graph, called L times, instead of L copies.
One JSON line: compile time (first call less a step), step time, peak RSS, the losses (equal in
both forms).

    python benchmarks/no_inline_layer.py LAYERS {0|1} [stop|keep]    # 1: no_inline

``keep`` passes the frozen weights without ``ops.stop_gradient`` (the shared backward then
computes their gradients too, for nothing); ``stop`` (default) stops them.

Measured on 2026-12-07 (docs/performance.md, "Time to first step").
"""
import json
import resource
import sys
import time

import mindqwen  # noqa: F401  first: it sets what MindSpore reads when it loads
import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindqwen import backend

ms.set_context(mode=ms.GRAPH_MODE)
backend.use_cpu_fusion()
L, NOINLINE = int(sys.argv[1]), sys.argv[2] == "1"
STOP = len(sys.argv) < 4 or sys.argv[3] == "stop"
H, N, KV, D, I, S, R = 896, 14, 2, 64, 4864, 512, 8
f32 = ms.float32
mm = ops.MatMul(transpose_b=True)
bmm_t = ops.BatchMatMul(transpose_b=True); bmm = ops.BatchMatMul()

def rms(x, w):
    return w * (x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + 1e-6))

def frozen(w):
    return ops.stop_gradient(w) if STOP else w


def lin(x2, w):
    return mm(x2, frozen(w))

def layer(x, cos, sin, mask, ln1, qw, qb, qa, qbb, kw, kb, vw, vb, va, vbb, ow, ln2, gw, uw, dw):
    b, s, h = x.shape
    x2 = rms(x, frozen(ln1)).reshape(-1, h)
    q = lin(x2, qw) + frozen(qb) + mm(mm(x2, qa), qbb) * 4.0
    k = lin(x2, kw) + frozen(kb)
    v = lin(x2, vw) + frozen(vb) + mm(mm(x2, va), vbb) * 4.0
    q = q.reshape(b, s, N, D).transpose(0, 2, 1, 3); k = k.reshape(b, s, KV, D).transpose(0, 2, 1, 3)
    v = v.reshape(b, s, KV, D).transpose(0, 2, 1, 3)
    half = D // 2
    q = q * cos + ops.cat((-q[..., half:], q[..., :half]), -1) * sin
    k = k * cos + ops.cat((-k[..., half:], k[..., :half]), -1) * sin
    q = q.reshape(b, KV, (N // KV) * s, D)
    sc = bmm_t(q, k) * (D ** -0.5)
    sc = sc.reshape(b, KV, N // KV, s, s) + mask
    p = ops.softmax(sc, -1).reshape(b, KV, (N // KV) * s, s)
    o = bmm(p, v).reshape(b, N, s, D).transpose(0, 2, 1, 3).reshape(-1, N * D)
    x = x + lin(o, ow).reshape(b, s, h)
    y2 = rms(x, frozen(ln2)).reshape(-1, h)
    m = lin(ops.silu(lin(y2, gw)) * lin(y2, uw), dw)
    return x + m.reshape(b, s, h)

shared = ms.no_inline(layer) if NOINLINE else layer
rng = np.random.default_rng(0)
def P(shape, name, grad=False, zero=False):
    a = np.zeros(shape, np.float32) if zero else (rng.standard_normal(shape).astype(np.float32) * 0.02)
    return Parameter(Tensor(a), name=name, requires_grad=grad)

class Layer(nn.Cell):
    def __init__(self, i):
        super().__init__()
        self.ln1 = Parameter(Tensor(np.ones(H, np.float32)), name=f"l{i}.ln1", requires_grad=False)
        self.ln2 = Parameter(Tensor(np.ones(H, np.float32)), name=f"l{i}.ln2", requires_grad=False)
        self.qw, self.qb = P((N * D, H), f"l{i}.qw"), P((N * D,), f"l{i}.qb")
        self.kw, self.kb = P((KV * D, H), f"l{i}.kw"), P((KV * D,), f"l{i}.kb")
        self.vw, self.vb = P((KV * D, H), f"l{i}.vw"), P((KV * D,), f"l{i}.vb")
        self.qa, self.qbb = P((R, H), f"l{i}.qa", True), P((N * D, R), f"l{i}.qbb", True, True)
        self.va, self.vbb = P((R, H), f"l{i}.va", True), P((KV * D, R), f"l{i}.vbb", True, True)
        self.ow = P((H, N * D), f"l{i}.ow")
        self.gw, self.uw, self.dw = P((I, H), f"l{i}.gw"), P((I, H), f"l{i}.uw"), P((H, I), f"l{i}.dw")
    def construct(self, x, cos, sin, mask):
        return shared(x, cos, sin, mask, self.ln1, self.qw, self.qb, self.qa, self.qbb, self.kw, self.kb, self.vw,
                      self.vb, self.va, self.vbb, self.ow, self.ln2, self.gw, self.uw, self.dw)

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Layer(i) for i in range(L)])
    def construct(self, x, cos, sin, mask):
        for l in self.layers:
            x = l(x, cos, sin, mask)
        return (x * x).mean()

net = Net()
params = net.trainable_params()
opt = nn.AdamWeightDecay(params, 1e-4)
class Step(nn.Cell):
    def __init__(self):
        super().__init__()
        self.net, self.opt = net, opt
        self.g = ms.value_and_grad(net, None, opt.parameters)
    def construct(self, x, cos, sin, mask):
        loss, g = self.g(x, cos, sin, mask)
        self.opt(g)
        return loss
step = Step()
x = Tensor(rng.standard_normal((1, S, H)).astype(np.float32))
ang = np.outer(np.arange(S), 1e6 ** -(np.arange(0, D, 2) / D)); ang = np.concatenate([ang, ang], -1)
cos, sin = Tensor(np.cos(ang)[None, None].astype(np.float32)), Tensor(np.sin(ang)[None, None].astype(np.float32))
mask = Tensor((np.triu(np.ones((S, S)), 1) * -1e9).astype(np.float32)[None, None, None])
t = time.perf_counter(); l0 = step(x, cos, sin, mask).asnumpy(); first = time.perf_counter() - t
ts = []
for _ in range(3):
    t = time.perf_counter(); l = step(x, cos, sin, mask).asnumpy(); ts.append(time.perf_counter() - t)
print(json.dumps({"layers": L, "no_inline": NOINLINE, "frozen": "stop" if STOP else "keep", "first_s": round(first, 2), "step_s": round(min(ts), 3),
                  "compile_s": round(first - min(ts), 2), "loss0": float(l0), "loss": float(l),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
