"""Minimal reproduction: ``mindspore.lazy_inline`` (compile a repeated Cell once) on the CPU.

MindSpore 2.10's CPU backend cannot run a graph whose decoder blocks are reused subgraphs: the
forward pass alone fails with "Input[0] must be a Primitive ValueNode, but get
ValueNode<FuncGraph> ..." (backend/ms_backend/segment_runner.cc, TransformSegmentToAnfGraph),
at every ``jit_level`` (O0, O1, O2), with and without graph-kernel fusion. Without the decorator
the same network runs. So on the CPU the layer stack is compiled unrolled (docs/performance.md).

    python benchmarks/repro_lazy_inline.py          # prints: forward / grad fail, plain runs
"""
import mindspore as ms
from mindspore import nn, ops


def block_class(lazy: bool):
    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(16, 16)

        def construct(self, x):
            return x + ops.silu(self.dense(x))

    if lazy:
        Block.__init__ = ms.lazy_inline(Block.__init__)
    return Block


class Net(nn.Cell):
    def __init__(self, block, n: int = 4):
        super().__init__()
        self.blocks = nn.CellList([block() for _ in range(n)])

    def construct(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def main() -> None:
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    x = ops.ones((2, 16), ms.float32)
    for lazy in (True, False):
        net = Net(block_class(lazy))
        for what, run in (("forward", lambda: net(x)),
                          ("grad", lambda: ms.value_and_grad(net, None, net.trainable_params())(x)[0])):
            try:
                print(f"lazy_inline={lazy} {what}: runs, {float(run().asnumpy()):.4f}")
            except RuntimeError as e:
                print(f"lazy_inline={lazy} {what}: fails: {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()
