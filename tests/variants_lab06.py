"""Lab 06's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations


VARIANTS: dict[str, dict[str, list[str]]] = {
    "lab06/fake_quantize": {
        "wrong": ["import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    out_f, in_f = w.shape\n"
                  "    g = in_f if group_size is None else group_size\n"
                  "    x = w.reshape(out_f, in_f // g, g)\n"
                  "    if symmetric:\n"
                  "        scale = x.abs().amax(-1, keepdim=True) / 2 ** (bits - 1)  # 8 levels up for int4, not 7\n"
                  "        return (torch.clamp(torch.round(x / scale), -2 ** (bits - 1), 2 ** (bits - 1) - 1) * scale).reshape(w.shape)\n"
                  "    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)\n"
                  "    scale = (hi - lo) / (2 ** bits - 1)\n"
                  "    return (torch.clamp(torch.round((x - lo) / scale), 0, 2 ** bits - 1) * scale + lo).reshape(w.shape)\n",
                  "import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    out_f, in_f = w.shape\n"
                  "    g = in_f if group_size is None else group_size\n"
                  "    x = w.reshape(out_f, in_f // g, g)\n"
                  "    if symmetric:\n"
                  "        qmax = 2 ** (bits - 1) - 1\n"
                  "        scale = x.abs().amax(-1, keepdim=True) / qmax\n"
                  "        return (torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale).reshape(w.shape)\n"
                  "    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)\n"
                  "    scale = (hi - lo) / (2 ** bits - 1)\n"
                  "    zero = torch.round(-lo / scale)  # an integer zero point: min is no longer exact\n"
                  "    return ((torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1) - zero) * scale).reshape(w.shape)\n"],
        "right": ["import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    g = w.shape[1] if group_size is None else group_size\n"
                  "    cols = []\n"
                  "    for j in range(0, w.shape[1], g):  # one group of columns at a time\n"
                  "        x = w[:, j:j + g]\n"
                  "        if symmetric:\n"
                  "            step = (x.abs().max(dim=1, keepdim=True).values / (2 ** (bits - 1) - 1)).clamp(min=1e-12)\n"
                  "            cols.append((x / step).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * step)\n"
                  "        else:\n"
                  "            lo = x.min(dim=1, keepdim=True).values\n"
                  "            step = ((x.max(dim=1, keepdim=True).values - lo) / (2 ** bits - 1)).clamp(min=1e-12)\n"
                  "            cols.append(((x - lo) / step).round().clamp(0, 2 ** bits - 1) * step + lo)\n"
                  "    return torch.cat(cols, dim=1)\n"],
    },
    "lab06/pack_int4": {
        "wrong": ["def pack_int4(codes):\n"
                  "    return (codes[..., 0::2] << 4) | codes[..., 1::2]  # even index in the high nibble\n",
                  "import torch\n"
                  "def pack_int4(codes):\n"
                  "    half = codes.shape[-1] // 2  # ggml's block order: j with j + n/2, not neighbours\n"
                  "    return codes[..., :half] | (codes[..., half:] << 4)\n"],
        "right": ["import torch\n"
                  "def pack_int4(codes):\n"
                  "    pairs = codes.reshape(*codes.shape[:-1], -1, 2).to(torch.int32)\n"
                  "    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)\n"],
    },
    "lab06/int4_matmul": {
        "wrong": ["import torch\n"
                  "def int4_matmul(x, packed, scale, minimum, group_size):\n"
                  "    codes = torch.stack([packed >> 4, packed & 0xF], -1).reshape(packed.shape[0], -1)  # high nibble first\n"
                  "    g = codes.float().reshape(codes.shape[0], -1, group_size)\n"
                  "    w = (g * scale[..., None] + minimum[..., None]).reshape(codes.shape[0], -1)\n"
                  "    return x @ w.T\n",
                  "import torch\n"
                  "def int4_matmul(x, packed, scale, minimum, group_size):\n"
                  "    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)\n"
                  "    g = codes.float().reshape(codes.shape[0], -1, group_size)\n"
                  "    w = (g * scale[..., None]).reshape(codes.shape[0], -1)  # symmetric thinking: forgot the minimum\n"
                  "    return x @ w.T\n",
                  "import torch\n"
                  "def int4_matmul(x, packed, scale, minimum, group_size):\n"
                  "    # low nibbles of all bytes, then all high nibbles: ggml's block order, not neighbours\n"
                  "    codes = torch.cat([packed & 0xF, packed >> 4], -1)\n"
                  "    g = codes.float().reshape(codes.shape[0], -1, group_size)\n"
                  "    w = (g * scale[..., None] + minimum[..., None]).reshape(codes.shape[0], -1)\n"
                  "    return x @ w.T\n"],
        "right": ["import torch\n"
                  "def int4_matmul(x, packed, scale, minimum, group_size):\n"
                  "    # group by group, never forming the whole weight: y = sum_g x_g @ (scale_g * codes_g + min_g).T\n"
                  "    lo, hi = (packed % 16).to(torch.float32), (packed // 16).to(torch.float32)\n"
                  "    codes = torch.empty(packed.shape[0], 2 * packed.shape[1])\n"
                  "    codes[:, 0::2], codes[:, 1::2] = lo, hi\n"
                  "    y = torch.zeros(x.shape[0], packed.shape[0])\n"
                  "    for g in range(codes.shape[1] // group_size):\n"
                  "        sl = slice(g * group_size, (g + 1) * group_size)\n"
                  "        xg = x[:, sl]\n"
                  "        # scale * (x . codes) + min * sum(x): the trick int4 kernels use for the minimum\n"
                  "        y += (xg @ codes[:, sl].T) * scale[:, g] + xg.sum(1, keepdim=True) * minimum[:, g]\n"
                  "    return y\n"],
    },
    "lab06/smoothquant_scales": {
        "wrong": ["import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)\n"
                  "    w_absmax = ws[0].abs().amax(0)  # only the first weight (q), not k and v\n"
                  "    return act_absmax.clamp_min(1e-5) ** alpha / w_absmax.clamp_min(1e-5) ** (1 - alpha)\n",
                  "import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)\n"
                  "    w_absmax = torch.cat(ws).abs().amax(0)\n"
                  "    return act_absmax.clamp_min(1e-5) ** (1 - alpha) / w_absmax.clamp_min(1e-5) ** alpha  # exponents swapped\n"],
        "right": ["import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    if isinstance(weights, torch.Tensor):\n"
                  "        weights = [weights]\n"
                  "    w_absmax = torch.stack([w.abs().max(dim=0).values for w in weights]).max(dim=0).values\n"
                  "    a, b = act_absmax.clamp(min=1e-5), w_absmax.clamp(min=1e-5)\n"
                  "    return torch.exp(alpha * torch.log(a) - (1 - alpha) * torch.log(b))\n"],
    },
    "lab06/awq_scale_search": {
        "wrong": ['from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n'
                  'def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n'
                  '    s_x = x.abs().mean(0)\n'
                  '    best = None\n'
                  '    for i in range(1, grid):  # the grid starts at 1/grid: alpha 0 (plain RTN) is never tried\n'
                  '        s = s_x.pow(i / grid).clamp_min(1e-4)\n'
                  '        s = s / (s.max() * s.min()).sqrt()\n'
                  '        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s\n'
                  '        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n'
                  '        if best is None or loss < best[0]:\n'
                  '            best = (loss, s)\n'
                  '    return best[1]\n',
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_x = x.abs().mean(0)\n"
                  "    best = None\n"
                  "    for i in range(grid):\n"
                  "        s = s_x.pow(i / grid).clamp_min(1e-4)\n"
                  "        s = s / (s.max() * s.min()).sqrt()\n"
                  "        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True)  # forgot / s\n"
                  "        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n"
                  "        if best is None or loss < best[0]:\n"
                  "            best = (loss, s)\n"
                  "    return best[1]\n",
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_w = w.abs().mean(0)  # salient by weight magnitude, not by activation\n"
                  "    best = None\n"
                  "    for i in range(grid):\n"
                  "        s = s_w.pow(i / grid).clamp_min(1e-4)\n"
                  "        s = s / (s.max() * s.min()).sqrt()\n"
                  "        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s\n"
                  "        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n"
                  "        if best is None or loss < best[0]:\n"
                  "            best = (loss, s)\n"
                  "    return best[1]\n"],
        "right": ["import torch\n"
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_x = x.abs().sum(0) / x.shape[0]\n"
                  "    candidates, losses = [], []\n"
                  "    for alpha in [i / grid for i in range(grid)]:\n"
                  "        s = torch.clamp(s_x ** alpha, min=1e-4)\n"
                  "        s = s / torch.sqrt(s.max() * s.min())\n"
                  "        err = x @ (rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s - w).T\n"
                  "        candidates.append(s)\n"
                  "        losses.append(float((err ** 2).sum()))  # a sum: the same argmin as the mean\n"
                  "    return candidates[losses.index(min(losses))]\n"],
    },
    "lab06/mask_2_4": {
        "wrong": ["import torch\n"
                  "def mask_2_4(w):\n"
                  "    g = w.reshape(w.shape[0], -1, 4)  # by signed value, not magnitude\n"
                  "    top2 = torch.argsort(g, dim=-1, descending=True, stable=True)[..., :2]\n"
                  "    return torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top2, True).reshape(w.shape)\n",
                  "import torch\n"
                  "def mask_2_4(w):\n"
                  "    g = w.abs().reshape(-1, 4, w.shape[1] // 4).transpose(1, 2)  # groups strided across the row\n"
                  "    top2 = torch.argsort(g, dim=-1, descending=True, stable=True)[..., :2]\n"
                  "    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top2, True)\n"
                  "    return keep.transpose(1, 2).reshape(w.shape)\n"],
        "right": ["import torch\n"
                  "def mask_2_4(w):\n"
                  "    mask = torch.zeros(w.shape, dtype=torch.bool)\n"
                  "    a = w.abs()\n"
                  "    for r in range(w.shape[0]):\n"
                  "        for j in range(0, w.shape[1], 4):\n"
                  "            order = sorted(range(4), key=lambda k: (-a[r, j + k].item(), k))  # ties: earlier first\n"
                  "            for k in order[:2]:\n"
                  "                mask[r, j + k] = True\n"
                  "    return mask\n"],
    },
    "lab06/distillation_loss": {
        "wrong": ["import torch\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    log_q = torch.log_softmax(student_logits.reshape(-1, V) / T, -1)\n"
                  "    log_p = torch.log_softmax(teacher_logits.reshape(-1, V) / T, -1)\n"
                  "    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()  # no T^2\n"
                  "    ce = torch.nn.functional.cross_entropy(student_logits.reshape(-1, V), labels.reshape(-1))\n"
                  "    return alpha * kl + (1 - alpha) * ce\n",
                  "import torch\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    log_q = torch.log_softmax(student_logits.reshape(-1, V) / T, -1)\n"
                  "    log_p = torch.log_softmax(teacher_logits.reshape(-1, V) / T, -1)\n"
                  "    kl = (log_q.exp() * (log_q - log_p)).sum(-1).mean()  # KL(student || teacher): the other direction\n"
                  "    ce = torch.nn.functional.cross_entropy(student_logits.reshape(-1, V), labels.reshape(-1))\n"
                  "    return alpha * T * T * kl + (1 - alpha) * ce\n"],
        "right": ["import torch\n"
                  "import torch.nn.functional as F\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    s, t = student_logits.reshape(-1, V), teacher_logits.reshape(-1, V)\n"
                  "    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), reduction='batchmean', log_target=True)\n"
                  "    return alpha * T ** 2 * kl + (1 - alpha) * F.cross_entropy(s, labels.reshape(-1))\n"],
    },
}
