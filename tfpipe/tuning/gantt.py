"""A Gantt chart of a measured pipeline timeline, as a PNG: one row per device.

Drawn with Pillow, which tensorboard (a tfpipe dependency) already installs:
a few rectangles and labels do not justify matplotlib (~40 MB). Colours: blue
forward, orange recompute, green backward; a lighter shade for odd
micro-batches so neighbouring tasks stay distinguishable; idle time is white.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from PIL import Image, ImageDraw, ImageFont

from tfpipe.pipeline.recorder import Label

COLORS = {'forward': ((31, 119, 180), (114, 168, 207)),
          'recompute': ((255, 127, 14), (255, 178, 110)),
          'backward': ((44, 160, 44), (120, 200, 120))}
OTHER = ((127, 127, 127), (180, 180, 180))
ROW_HEIGHT, ROW_GAP, LEFT, RIGHT, TOP, BOTTOM = 28, 8, 120, 20, 34, 40
WIDTH = 1200


class Interval(Protocol):
    @property
    def label(self) -> Label: ...

    @property
    def start(self) -> float: ...  # seconds from the chart's origin

    @property
    def end(self) -> float: ...


class Chart(Protocol):
    """What the drawing reads of a timeline (`tfpipe.tuning.timeline.Timeline`), which
    imports this module to draw itself: so this one names no timeline class."""

    @property
    def devices(self) -> Sequence[str]: ...

    @property
    def events(self) -> Sequence[Interval]: ...

    @property
    def span(self) -> float: ...


def write_png(timeline: Chart, path: str, title: str = '') -> None:
    rows = len(timeline.devices)
    height = TOP + rows * (ROW_HEIGHT + ROW_GAP) + BOTTOM
    image = Image.new('RGB', (WIDTH, height), 'white')
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    span = max(timeline.span, 1e-9)
    plot_width = WIDTH - LEFT - RIGHT

    def x_of(seconds: float) -> float:
        return LEFT + plot_width * seconds / span

    draw.text((LEFT, 8), title, fill='black', font=font)
    for row, device in enumerate(timeline.devices):
        top = TOP + row * (ROW_HEIGHT + ROW_GAP)
        draw.text((6, top + ROW_HEIGHT // 3), device.split('device:')[-1], fill='black',
                  font=font)
        draw.rectangle([LEFT, top, LEFT + plot_width, top + ROW_HEIGHT], outline=(200, 200, 200))
        for event in timeline.events:
            if event.label.device != device:
                continue
            shade = COLORS.get(event.label.phase, OTHER)[event.label.micro_batch % 2]
            x0, x1 = x_of(event.start), max(x_of(event.end), x_of(event.start) + 1)
            draw.rectangle([x0, top + 1, x1, top + ROW_HEIGHT - 1], fill=shade)
            label = str(event.label.micro_batch)
            if x1 - x0 > 8 * len(label):
                draw.text((x0 + 2, top + ROW_HEIGHT // 3), label, fill='white', font=font)
    axis = TOP + rows * (ROW_HEIGHT + ROW_GAP)
    for i in range(6):
        seconds = span * i / 5
        x = x_of(seconds)
        draw.line([x, axis, x, axis + 5], fill='black')
        draw.text((x - 12, axis + 8), f'{seconds * 1e3:.1f} ms', fill='black', font=font)
    legend_x = WIDTH - 3 * 100 - RIGHT
    for i, (phase, (color, _)) in enumerate(COLORS.items()):
        draw.rectangle([legend_x + i * 100, 10, legend_x + i * 100 + 10, 20], fill=color)
        draw.text((legend_x + i * 100 + 14, 8), phase, fill='black', font=font)
    image.save(path, format='PNG')
