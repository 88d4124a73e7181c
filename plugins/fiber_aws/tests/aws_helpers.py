"""What the fiber-aws tests share: the moto service, its Batch queues, and the bounds of their waits.

Named ``aws_helpers`` (not ``conftest``) so that test modules can import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
REGION = "us-east-1"
IMAGE = os.environ.get("FIBER_AWS_TEST_IMAGE") or "fiber-test:latest"  # one built from this branch, where its wire version differs
CPU_QUEUE = "fiber-cpu"
GPU_QUEUES = {"a10g": ("fiber-gpu-a10g", "g5.xlarge"), "t4": ("fiber-gpu-t4", "g4dn.xlarge")}
FAR_QUEUE = "fiber-far"  # its compute environment is in a VPC this machine is not part of
SPOT_QUEUE = "fiber-spot"  # its compute environment runs on Spot instances
WAIT = 120.0  # bound of every wait on a job


def read_env(path: Path) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of a service's env file (``{}`` while it is down)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def ensure_infrastructure(endpoint: str) -> None:
    """Compute environments and job queues in moto: one CPU queue, one queue per GPU type."""
    kw = {"region_name": REGION, "endpoint_url": endpoint}
    iam, ec2, batch = boto3.client("iam", **kw), boto3.client("ec2", **kw), boto3.client("batch", **kw)
    try:
        role = iam.get_role(RoleName="fiber-batch-service")["Role"]
    except iam.exceptions.NoSuchEntityException:
        role = iam.create_role(RoleName="fiber-batch-service", AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                    "Principal": {"Service": "batch.amazonaws.com"}}]}))["Role"]
    try:
        profile = iam.get_instance_profile(InstanceProfileName="fiber-ecs-instance")["InstanceProfile"]
    except iam.exceptions.NoSuchEntityException:
        profile = iam.create_instance_profile(InstanceProfileName="fiber-ecs-instance")["InstanceProfile"]

    def network(name: str, cidr: str) -> tuple[str, str]:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:Name", "Values": [name]}])["Vpcs"]
        if vpcs:
            vpc = vpcs[0]["VpcId"]
            subnet = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"][0]["SubnetId"]
            sg = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                                       {"Name": "group-name", "Values": [name]}])
            return subnet, sg["SecurityGroups"][0]["GroupId"]
        vpc = ec2.create_vpc(CidrBlock=cidr, TagSpecifications=[
            {"ResourceType": "vpc", "Tags": [{"Key": "Name", "Value": name}]}])["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr.replace("/16", "/24"))["Subnet"]["SubnetId"]
        sg = ec2.create_security_group(GroupName=name, Description="fiber jobs", VpcId=vpc)["GroupId"]
        return subnet, sg

    here = network("fiber-loopback", "127.0.0.0/16")
    far = network("fiber-far", "10.77.0.0/16")
    wanted = {CPU_QUEUE: (["m5.large"], here, "EC2"), FAR_QUEUE: (["m5.large"], far, "EC2"),
              SPOT_QUEUE: (["m5.large"], here, "SPOT")}
    wanted.update({q: ([itype], here, "EC2") for q, itype in GPU_QUEUES.values()})
    existing = {q["jobQueueName"] for q in batch.describe_job_queues()["jobQueues"]}
    for queue, (types, (subnet, sg), capacity) in wanted.items():
        if queue in existing:
            continue
        ce = batch.create_compute_environment(
            computeEnvironmentName=f"{queue}-ce", type="MANAGED", state="ENABLED", serviceRole=role["Arn"],
            computeResources={"type": capacity, "minvCpus": 0, "maxvCpus": 64, "instanceTypes": types,
                              "subnets": [subnet], "securityGroupIds": [sg],
                              "instanceRole": profile["Arn"]})
        batch.create_job_queue(jobQueueName=queue, state="ENABLED", priority=1,
                               computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce["computeEnvironmentArn"]}])
