"""What the language-model head computes from hidden states, a block of rows at a time so the
whole (T, V) logits never exist: the cross-entropy loss, each labelled token's log-probability
(preference losses) and an evaluation's per-token scores. The loss and the log-probs form their
gradients block by block, in their own backward or, for models with frozen weights, in the forward."""
import mindspore as ms
from mindspore import nn, ops

from mindqwen.config import IGNORE_INDEX


def label_log_probs(logits, labels):
    """logits (T, V) fp32, labels (T,) int32 → log p(label) (T, 1), 0 where the label is ignored."""
    keep = (labels != IGNORE_INDEX).reshape(-1, 1)
    safe = ops.select(keep, labels.reshape(-1, 1), ops.zeros_like(labels.reshape(-1, 1)))
    return ops.gather_elements(ops.log_softmax(logits, -1), 1, safe) * keep.astype(ms.float32)


def label_scores(logits, labels):
    """logits (T, V) fp32, labels (T,) int32 → log p(label) (T,), 0 where ignored, and whether
    the label is the argmax (T,) bool, True where ignored: what an evaluation asks of a token."""
    keep = labels != IGNORE_INDEX
    greedy = ops.logical_or(ops.argmax(logits, -1).astype(ms.int32) == labels, ops.logical_not(keep))
    return label_log_probs(logits, labels).reshape(-1), greedy


_MATMUL_NT = ops.MatMul(transpose_b=True)  # h (r, H) · W (V, H)ᵀ
_MATMUL_NN = ops.MatMul()  # dlogits (r, V) · W (V, H)
_MATMUL_TN = ops.MatMul(transpose_a=True)  # dlogits (r, V)ᵀ · h (r, H)


def label_scores_in_blocks(h, w, labels, rows: int):
    """h (T, H); w (V, H); labels (T,) int32 → ``label_scores`` of the logits h·Wᵀ, taken
    ``rows`` rows at a time: log p(label) (T,) fp32 and whether it is the argmax (T,) bool."""
    values, greedy = (), ()
    for start in range(0, h.shape[0], rows):  # unrolled: T is static
        v, g = label_scores(_MATMUL_NT(h[start:start + rows], w).astype(ms.float32), labels[start:start + rows])
        values, greedy = values + (v,), greedy + (g,)
    return ops.cat(values, 0), ops.cat(greedy, 0)


class _LogitBlocks(nn.Cell):
    """The cross-entropy of the logits h·Wᵀ taken ``rows`` rows at a time, so no pass holds more
    than one (rows, V) fp32 block of logits (the chunked cross-entropy of torchtune and Liger):
    its value, and its gradients formed block by block from each block's softmax p, with c = dout
    for kept rows, 0 for ignored ones:

        dlogits = c·(p − onehot(label))                       (rows, V), one block at a time
        dh      = c·p·W − c·W[label]                          (rows, H)
        dW     += (c·p)ᵀ·h, then −c·h scattered to the label rows   (V, H)

    ``weight_grad``: whether the head trains (``QwenForCausalLM.sync_with_weights``).
    """

    def __init__(self, rows: int, weight_grad: bool = True):
        super().__init__()
        self.rows, self.weight_grad = rows, weight_grad

    def value(self, h, w, labels):
        """h (T, H); w (V, H); labels (T,) int32, -100 ignored → the summed loss (fp32 scalar)."""
        total = ops.zeros((), ms.float32)
        for start in range(0, h.shape[0], self.rows):  # unrolled: T is static; slices clip at T
            logits = _MATMUL_NT(h[start:start + self.rows], w).astype(ms.float32)  # (r, V)
            total = total - ops.reduce_sum(label_log_probs(logits, labels[start:start + self.rows]))
        return total


def _block(hc, w, labels, dout):
    """One block: hc (r, H), labels (r,), dout (scalar or (r, 1)) → dh (r, H) fp32, c·p (r, V),
    the safe labels (r, 1), c (r, 1), and the labels' log-probs (r, 1), 0 where ignored (one
    logits matmul for all of them). dh is the gradient of −Σ dout·log p(label)."""
    lab = labels.reshape(-1, 1)
    keep = (lab != IGNORE_INDEX).astype(ms.int32)
    safe = lab * keep  # ignored rows point at row 0 with a zero coefficient
    coef = keep.astype(ms.float32) * dout  # (r, 1)
    log_probs = ops.log_softmax(_MATMUL_NT(hc, w).astype(ms.float32), -1)  # (r, V)
    label_logps = ops.gather_elements(log_probs, 1, safe) * keep.astype(ms.float32)
    probs = ops.exp(log_probs) * coef  # (r, V)
    rows_w = ops.gather(w, safe.reshape(-1), 0).astype(ms.float32)  # (r, H): W[label]
    dh = _MATMUL_NN(probs.astype(w.dtype), w).astype(ms.float32) - coef * rows_w
    return dh, probs, safe, coef, label_logps


class ChunkedCrossEntropy(_LogitBlocks):
    """The chunked cross-entropy (``_LogitBlocks``) with its own backward: the forward keeps
    nothing for it but its inputs, and the backward recomputes each block's softmax."""

    def construct(self, h, w, labels):
        return self.value(h, w, labels)

    def bprop(self, h, w, labels, out, dout):
        # dW always: when the head is frozen nothing consumes it and the graph drops it. (The
        # loop is written out: MindSpore 2.10 fails to compile a bprop that calls a loop.)
        dh, dw = (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):
            hc = h[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, _ = _block(hc, w, labels[start:start + self.rows], dout)
            dh = dh + (dh_c.astype(h.dtype),)
            dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
            dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        return ops.cat(dh, 0), dw.astype(w.dtype), labels * 0


class ChunkedCrossEntropyInForward(_LogitBlocks):
    """The chunked cross-entropy (``_LogitBlocks``) whose training forward forms the gradients
    (dout 1) and returns loss + Σ (h − stop_gradient(h))·dh (+ the same for W): the value is the
    loss to the last bit (each added term is exactly 0) and its gradient is dout·(dh, dW).

    For models with frozen weights: MindSpore 2.10 fails to differentiate a graph that holds a
    Cell ``bprop`` beside a layer compiled once (``no_inline``) that stops a frozen weight's
    gradient ("func graph is empty: zeros_like"). With a frozen head only dh (T, H) waits for the
    backward; a trained head's dW (V, H) would wait too (+2 GB at the Qwen2.5-0.5B shape), so
    full fine-tunes keep ``ChunkedCrossEntropy``. Outside training the forward is the loss alone.
    """

    def construct(self, h, w, labels):
        if not self.training:
            return self.value(h, w, labels)
        hs, ws = ops.stop_gradient(h), ops.stop_gradient(w)
        total, dh, dw = ops.zeros((), ms.float32), (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):  # ChunkedCrossEntropy.bprop's with dout 1
            hc = hs[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, log_probs = _block(hc, ws, labels[start:start + self.rows],
                                                        ops.ones((), ms.float32))
            total, dh = total - ops.reduce_sum(log_probs), dh + (dh_c,)
            if self.weight_grad:
                dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
                dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        dh = ops.cat(dh, 0)
        total = total + ops.reduce_sum((h - hs).astype(ms.float32) * dh.astype(ms.float32))
        if self.weight_grad:
            total = total + ops.reduce_sum((w - ws).astype(ms.float32) * dw.astype(ms.float32))
        return total


class _TokenLogProbs(_LogitBlocks):
    """Each labelled token's log-probability (T,) fp32 (0 where ignored), from the logits h·Wᵀ
    taken ``rows`` rows at a time: the log-probs of sequences, for preference losses."""

    def token_values(self, h, w, labels):
        """h (T, H); w (V, H); labels (T,) → log p(label) (T,) fp32, 0 where ignored."""
        pieces = ()
        for start in range(0, h.shape[0], self.rows):  # unrolled: T is static; slices clip at T
            logits = _MATMUL_NT(h[start:start + self.rows], w).astype(ms.float32)  # (r, V)
            pieces = pieces + (label_log_probs(logits, labels[start:start + self.rows]).reshape(-1),)
        return ops.cat(pieces, 0)


class TokenLogProbs(_TokenLogProbs):
    """``_TokenLogProbs`` with its own backward: for a per-token dout (T,) it forms the gradients
    of Σ dout·log p block by block, recomputing each block's softmax (``_LogitBlocks``, with
    c = −dout)."""

    def construct(self, h, w, labels):
        return self.token_values(h, w, labels)

    def bprop(self, h, w, labels, out, dout):
        # written out as ChunkedCrossEntropy.bprop's (a bprop cannot call a loop in MindSpore 2.10)
        dh, dw = (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):
            hc = h[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, _ = _block(hc, w, labels[start:start + self.rows],
                                                -dout[start:start + self.rows].reshape(-1, 1))
            dh = dh + (dh_c.astype(h.dtype),)
            dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
            dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        return ops.cat(dh, 0), dw.astype(w.dtype), labels * 0


class TokenLogProbsInForward(_TokenLogProbs):
    """``_TokenLogProbs`` whose training forward forms each token's gradient g_t = ∂log p_t/∂h_t
    (T, H) and returns log p + Σ_k (h − stop_gradient(h))·g: the value to the last bit, the
    gradient w.r.t. h exact for any function of the log-probs. For models with frozen weights
    (see ``ChunkedCrossEntropyInForward``); the head must be frozen (no dW is formed)."""

    def construct(self, h, w, labels):
        if not self.training:
            return self.token_values(h, w, labels)
        hs, ws = ops.stop_gradient(h), ops.stop_gradient(w)
        values, grads = (), ()
        for start in range(0, h.shape[0], self.rows):
            dh_c, _, _, _, log_probs = _block(hs[start:start + self.rows], ws, labels[start:start + self.rows],
                                              -ops.ones((), ms.float32))
            values, grads = values + (log_probs.reshape(-1),), grads + (dh_c,)
        return ops.cat(values, 0) + ops.reduce_sum((h - hs).astype(ms.float32) * ops.cat(grads, 0), -1)

