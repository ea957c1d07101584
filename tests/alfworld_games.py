"""Tiny hand-written ALFWorld games (no downloaded data), as ``alfworld-download`` ships them
(importable because pytest's ``pythonpath`` includes ``tests/``).

Each game is a ``game.tw-pddl`` JSON file: ALFWorld's PDDL domain and text grammar (both inside the
``alfworld`` package) with the goal sentence filled in, a PDDL problem written below, and
``solvable: true``.
"""

import json

# ALFRED object ids as in the real data: "Apple|-01.00|+00.90|+01.00" mangled to PDDL-safe names; the
# suite's demangler shows them as "apple 1".
APPLE = "Apple_bar__minus_01_dot_00_bar__plus_00_dot_90_bar__plus_01_dot_00"
MUG = "Mug_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_00"
COUNTER = "CounterTop_bar__minus_01_dot_00_bar__plus_00_dot_95_bar__plus_01_dot_00"
FRIDGE = "Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00"
CABINET = "Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_00_bar__plus_01_dot_00"


def problem(target_type: str, destination_type: str) -> str:
    """A kitchen with a countertop (apple and mug on it), a closed fridge and a closed cabinet; the goal
    is "put a <target_type> in/on a <destination_type>" (ALFWorld's pick_and_place_simple)."""
    return f"""(define (problem plan_tiny)
(:domain alfred)
(:objects
    agent1 - agent
    AppleType MugType - otype
    CounterTopType FridgeType CabinetType - rtype
    {APPLE} {MUG} - object
    {COUNTER} {FRIDGE} {CABINET} - receptacle
    loc_bar_start loc_bar_counter loc_bar_fridge loc_bar_cabinet - location
)
(:init
    (atLocation agent1 loc_bar_start)
    (receptacleType {COUNTER} CounterTopType)
    (receptacleType {FRIDGE} FridgeType)
    (receptacleType {CABINET} CabinetType)
    (receptacleAtLocation {COUNTER} loc_bar_counter)
    (receptacleAtLocation {FRIDGE} loc_bar_fridge)
    (receptacleAtLocation {CABINET} loc_bar_cabinet)
    (openable {FRIDGE})
    (openable {CABINET})
    (objectType {APPLE} AppleType)
    (objectType {MUG} MugType)
    (pickupable {APPLE})
    (pickupable {MUG})
    (inReceptacle {APPLE} {COUNTER})
    (inReceptacle {MUG} {COUNTER})
    (objectAtLocation {APPLE} loc_bar_counter)
    (objectAtLocation {MUG} loc_bar_counter)
    (canContain FridgeType AppleType)
    (canContain FridgeType MugType)
    (canContain CabinetType MugType)
    (canContain CounterTopType AppleType)
    (canContain CounterTopType MugType)
)
(:goal
    (exists (?r - receptacle)
        (exists (?o - object)
            (and
                (inReceptacle ?o ?r)
                (objectType ?o {target_type})
                (receptacleType ?r {destination_type})
            )
        )
    )
)
)
"""


def write_game(root, split, folder, goal, target, destination, solvable=True, walkthrough=None):
    """Write ``<root>/json_2.1.1/<split>/<folder>/trial_T0/game.tw-pddl``."""
    import alfworld.info

    grammar = open(alfworld.info.ALFRED_TWL2_PATH).read().replace("UNKNOWN GOAL", goal)
    data = {
        "pddl_domain": open(alfworld.info.ALFRED_PDDL_PATH).read(),
        "grammar": grammar,
        "pddl_problem": problem(f"{target}Type", f"{destination}Type"),
        "solvable": solvable,
    }
    if walkthrough is not None:
        data["walkthrough"] = walkthrough
    path = root / "json_2.1.1" / split / folder / "trial_T0" / "game.tw-pddl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return path


STORED_WALKTHROUGH = ["go to countertop 1", "take mug 1 from countertop 1", "go to cabinet 1", "open cabinet 1",
                      "move mug 1 to cabinet 1"]


def write_tiny_data(root):
    """Two playable ``pick_and_place_simple`` training games (the mug one with a stored walkthrough),
    three training games ALFWorld's loader skips (not solvable, movable receptacle, other task type)
    and one ``valid_unseen`` game, under ``root``."""
    write_game(root, "train", "pick_and_place_simple-Apple-None-Fridge-1", "put an apple in fridge", "Apple", "Fridge")
    write_game(root, "train", "pick_and_place_simple-Mug-None-Cabinet-1", "put a mug in cabinet", "Mug", "Cabinet",
               walkthrough=STORED_WALKTHROUGH)
    write_game(root, "train", "pick_and_place_simple-Mug-None-Fridge-2", "put a mug in fridge", "Mug", "Fridge", solvable=False)
    write_game(root, "train", "pick_and_place_with_movable_recep-Mug-Bowl-Fridge-1", "put a mug in fridge", "Mug", "Fridge")
    write_game(root, "train", "pick_heat_then_place_in_recep-Apple-None-Fridge-1", "put an apple in fridge", "Apple", "Fridge")
    write_game(root, "valid_unseen", "pick_and_place_simple-Mug-None-Fridge-3", "put a mug in fridge", "Mug", "Fridge")
    return root
