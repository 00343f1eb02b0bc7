"""Learning curves side by side as one self-contained SVG (no plotting library): one panel per
side, one line per seed, the panels sharing their axes so they compare at a glance.

    svg = panels_svg({"RL": {"seed 0": [(0, 0.5), (900, 0.96)]}, "distillation": {...}},
                     x_label="completions sampled", y_label="held-out accuracy", target=0.95)
"""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT, MARGIN = 360, 260, 48
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def panels_svg(panels: dict[str, dict[str, list[tuple[float, float]]]], *, x_label: str, y_label: str,
               target: float | None = None) -> str:
    """The panels left to right; y runs 0..1, x 0..the largest x of any line; a dashed line at `target`."""
    x_max = max([x for lines in panels.values() for points in lines.values() for x, _ in points] + [1])
    inner_w, inner_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def at(x: float, y: float, left: float) -> str:
        return f"{left + MARGIN + x / x_max * inner_w:.1f},{MARGIN + (1 - y) * inner_h:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * len(panels)}" height="{HEIGHT}" '
             'font-family="sans-serif" font-size="11">']
    for index, (title, lines) in enumerate(panels.items()):
        left = index * WIDTH
        parts += [f'<text x="{left + WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
                  f'<rect x="{left + MARGIN}" y="{MARGIN}" width="{inner_w}" height="{inner_h}" fill="none" '
                  'stroke="#999"/>',
                  f'<text x="{left + WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle">{escape(x_label)}</text>',
                  f'<text x="{left + 12}" y="{HEIGHT / 2}" transform="rotate(-90 {left + 12} {HEIGHT / 2})" '
                  f'text-anchor="middle">{escape(y_label)}</text>',
                  f'<text x="{left + MARGIN}" y="{HEIGHT - MARGIN + 14}" text-anchor="middle">0</text>',
                  f'<text x="{left + WIDTH - MARGIN}" y="{HEIGHT - MARGIN + 14}" text-anchor="middle">{x_max:,.0f}</text>',
                  f'<text x="{left + MARGIN - 4}" y="{MARGIN + 4}" text-anchor="end">1</text>',
                  f'<text x="{left + MARGIN - 4}" y="{HEIGHT - MARGIN + 4}" text-anchor="end">0</text>']
        if target is not None:
            parts.append(f'<polyline points="{at(0, target, left)} {at(x_max, target, left)}" fill="none" '
                         'stroke="#999" stroke-dasharray="4 3"/>')
        for number, (label, points) in enumerate(lines.items()):
            colour = COLOURS[number % len(COLOURS)]
            drawn = " ".join(at(x, y, left) for x, y in points if y is not None)
            parts += [f'<polyline points="{drawn}" fill="none" stroke="{colour}" stroke-width="1.5"/>',
                      f'<text x="{left + MARGIN + 6}" y="{MARGIN + 14 + 13 * number}" fill="{colour}">'
                      f'{escape(label)}</text>']
    return "\n".join([*parts, "</svg>"]) + "\n"
